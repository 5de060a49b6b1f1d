"""Images for the PyTorch runner, whatever the family (whose record holds its preparer and
tower: ``families/vision/``): the encodes run a piece at a time between steps, the encoder
cache, and the step inputs that put image embeddings and positions into the decoder."""
