"""Block codecs for quantized collectives (qwZ weights, qgZ gradients), one job a module, each importing only those
listed before it: the wire format (``format``), the torch reference (``reference``), the fused C kernels
(``kernels.c``, built, loaded and called by ``native``), the Triton kernels (``triton_kernels``, imports none of
these), the choice of backend per call and the kernels' self-check (``backends``), and the ``BlockCodec`` API
(``block``). Every backend gives the bits of the torch reference."""
from __future__ import annotations

from .backends import kernel_status
from .block import INT4, INT8, BlockCodec, codec_from_spec, hop_codecs
from .format import DEFAULT_BLOCKS, Encoded, Order, same_bits

__all__ = ["BlockCodec", "Encoded", "INT8", "INT4", "codec_from_spec", "hop_codecs", "DEFAULT_BLOCKS", "Order",
           "kernel_status", "same_bits"]
