"""Stands in for ``nki.typing``: ``nt.tensor[128, 512]`` annotates a kernel parameter with the tensor shape
it expects (aws-neuron/aws-neuron-sdk, nki/migration/index.rst, "nki.typing module"; used by the
average_pool2d tutorial, nki/examples/average_pool2d/average_pool2d_nki_kernels.py). Annotations are
documentation here: the emulator does not check them."""


class tensor:
    """``tensor[shape...]``: an annotation naming a tensor parameter's shape."""

    def __class_getitem__(cls, shape):
        return _TensorAnnotation(shape if isinstance(shape, tuple) else (shape,))


class _TensorAnnotation:
    def __init__(self, shape):
        self.shape = shape

    def __repr__(self):
        return f"nki.typing.tensor[{', '.join(map(str, self.shape))}]"
