"""Write tiny random text encoders for a family, offline (tread/cli/tiny_text_encoders.py; `--help`).

    python scripts/tiny_text_encoders.py flux .cache/tiny_text_encoders/flux
"""
from tread.cli.tiny_text_encoders import main

if __name__ == "__main__":
    main()
