"""Precomputing latents (scripts/precompute_latents.py): images or clips, with their captions, loss masks and REPA
features, encoded once into the format tread.data reads: request.py -> plan.py -> run.py, with encode.py, video.py
and captions.py. It sits above the format (nothing in tread.data imports it; docs/design.md); this file imports
nothing, so importing one module loads only what it needs."""
