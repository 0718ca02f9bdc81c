"""qual: acceptance-rate qualification for DFlash speculative decoding under DCP."""

__version__ = "0.1.0"
