"""The runtime's public names in one place: pick a tuned kernel per problem.

The code lives in three modules; this one re-exports their public names so that callers keep
importing `drafter_attn.kernels.dispatch`:

- `kernels.tuned_table`  the typed `Entry` (per-layer latency computed once), the one ranking,
                         loading and checking a tuned table (JSON) or a profile database
- `kernels.dispatcher`   the `Dispatcher`: tiers exact / bucketed / family / default
- `kernels.runtime`      the `Runtime`: the four contract functions for a serving engine
- `kernels.shipped`      where the defaults are found (shipped per SM, or the environment)
"""

from drafter_attn.kernels.dispatcher import (CURRENT, TIERS, Dispatcher, Pick, default_pick,
                                             describe_key, fmt_params, problem_key)
from drafter_attn.kernels.runtime import Runtime
from drafter_attn.kernels.shipped import find_default
from drafter_attn.kernels.tuned_table import (DB_ROWS_SQL, DB_SCHEMA_NAME, DB_SCHEMA_VERSION,
                                              MAX_ALTERNATIVES, RULES, SHAPE_FIELDS, TABLE_FORMAT,
                                              TABLE_VERSION, Entry, Environment, TableError, bucket,
                                              current_environment, family, load_entries, load_table,
                                              make_table, per_layer_us, rank_key, read_db_rows,
                                              select_entries, validate_table)

__all__ = ["CURRENT", "TIERS", "Dispatcher", "Pick", "default_pick", "describe_key", "fmt_params",
           "problem_key", "Runtime", "find_default", "DB_ROWS_SQL", "DB_SCHEMA_NAME",
           "DB_SCHEMA_VERSION", "MAX_ALTERNATIVES", "RULES", "SHAPE_FIELDS", "TABLE_FORMAT",
           "TABLE_VERSION", "Entry", "Environment", "TableError", "bucket", "current_environment",
           "family", "load_entries", "load_table", "make_table", "per_layer_us", "rank_key",
           "read_db_rows", "select_entries", "validate_table"]
