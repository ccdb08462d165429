"""Train and cache the toy classifier, the built-in data's offline feature network (tread/cli/toy_classifier.py;
`--help`).

    python scripts/toy_classifier.py --cache-dir .cache --resolution 16
"""
from tread.cli.toy_classifier import main

if __name__ == "__main__":
    main()
