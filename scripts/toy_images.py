"""Write the toy shapes as an image folder with caption sidecars (tread/cli/example_assets.py; `--help`)."""
from tread.cli.example_assets import toy_images

if __name__ == "__main__":
    toy_images()
