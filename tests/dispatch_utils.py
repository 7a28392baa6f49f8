"""A dispatch recorder shared by the tests that check which aten ops a call runs (on fake CUDA
tensors: tests/test_cp_ragged.py, tests/test_varlen_attention.py)."""
from torch.utils._python_dispatch import TorchDispatchMode


class OpNames(TorchDispatchMode):
    """While active, the name (`aten.<op>`) of every op dispatched, in order, in `names`."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
