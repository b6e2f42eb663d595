"""The bottom layer: modules every other one may import, which import nothing of kvsplice."""
