"""cuflash: exact FlashAttention for NumPy and CuPy arrays."""
__version__ = "0.1.0"
