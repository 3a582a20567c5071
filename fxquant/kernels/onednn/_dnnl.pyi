from collections.abc import Sequence

def load(path: str) -> tuple[int, int, int]: ...

class Primitive:
    def __init__(self, weight_ptr: int, weight_dims: Sequence[int], src_dims: Sequence[int],
                 src_strides: Sequence[int], dst_dims: Sequence[int], dst_strides: Sequence[int], dst_type: str,
                 weight_scales: bytes, bias: bytes | None, src_scale: float, src_zero_point: int, dst_scale: float,
                 dst_zero_point: int,
                 conv: tuple[Sequence[int], Sequence[int], Sequence[int], Sequence[int]] | None,
                 eltwise: tuple[int, float, float] | None, sum: tuple[float, int] | None,
                 share: Sequence[Primitive] = ()) -> None: ...
    @property
    def weights_address(self) -> int: ...
    @property
    def weights_bytes(self) -> int: ...
    def run(self, src_ptr: int, dst_ptr: int, /) -> None: ...
