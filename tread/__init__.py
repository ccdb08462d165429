"""TREAD: token routing for diffusion-transformer training. The library behind train.py, sample.py, fid.py
and scripts/; docs/design.md describes its layers."""
