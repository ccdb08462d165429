"""The config schema: every key of train.yaml, sample.yaml and fid.yaml with its type and range, checked once
at start-up; one `error:` line per bad value (tread/schema/base.py says why pydantic). compose() builds a config
from configs/ the way the entry points do, for the planner, the benchmark and the tests."""
from tread.schema.base import ConfigError
from tread.schema.compose import CONFIG_DIR, compose
from tread.schema.programs import check_fid, check_sample
from tread.schema.train import MIXED_PRECISION, check_train, check_train_files

__all__ = ["CONFIG_DIR", "ConfigError", "MIXED_PRECISION", "check_fid", "check_sample", "check_train",
           "check_train_files", "compose"]
