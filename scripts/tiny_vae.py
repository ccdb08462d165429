"""Write a tiny AutoencoderKL fitted to the toy shapes (tread/cli/example_assets.py; `--help`)."""
from tread.cli.example_assets import tiny_vae

if __name__ == "__main__":
    tiny_vae()
