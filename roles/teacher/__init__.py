"""A scripted frozen teacher: answers the built-in tasks correctly over the inference protocol."""
