"""Images for the PyTorch runner: a vision family's image processing (API side), its vision
tower, and the step inputs that put image embeddings and positions into the decoder."""
