"""Every frozen network the project uses (VAE, text encoders, metric feature networks, REPA's patch encoders),
each loaded from a local path or failing with one EncoderError that says how to provide it.

A bottom-layer package: it imports only tread.utils. Nothing here trains or fetches a network as a side effect,
except the Inception weights, downloaded into the torch hub cache when missing and the network is up.
"""
