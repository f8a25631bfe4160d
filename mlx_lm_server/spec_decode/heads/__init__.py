"""Learned drafters that ship with checkpoints: MTP layers (``mtp.py``)."""
