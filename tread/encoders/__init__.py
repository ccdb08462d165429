"""Every frozen network the project uses, each loaded from a local path (or failing with one EncoderError
that says how to provide it): the VAE (vae.py), text encoders per family (text.py) and tiny random offline
ones (tiny_text.py), the toy-shapes classifier (toy_classifier.py), the metric feature networks (features.py:
Inception, the toy classifier's features, FDD's DINOv2), DINOv2 loading (dinov2.py) and REPA's patch encoders
(patch.py).

A bottom-layer package: it imports only tread.utils (and third-party libraries). Callers above resolve the
paths (data builds the toy classifier from its built-in images; evaluation and training pick the files), so
nothing here trains or fetches a network as a side effect of asking for one, except the Inception weights,
which are downloaded into the torch hub cache when missing and the network is up (features.py).
"""
