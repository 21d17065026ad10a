"""Drafter geometries from public model configs (docs/design.md, "The problem").

Each entry names the Hugging Face config it was read from. Field mapping: num_hidden_layers ->
num_layers, num_attention_heads / num_key_value_heads -> heads, head_dim, block_size, and
sliding_window / layer_types -> mask and window. All drafters ship bfloat16 weights.
"""

from __future__ import annotations

from drafter_attn.kernels.spec import Geometry

MAIN_PRESET = "qwen3-8b-dflash-b16"

PRESETS: dict[str, Geometry] = {
    # z-lab/Qwen3-8B-DFlash-b16 config.json
    "qwen3-8b-dflash-b16": Geometry(32, 8, 128, 16, "full", num_layers=5),
    # z-lab/Qwen3-Coder-30B-A3B-DFlash config.json
    "qwen3-coder-30b-dflash": Geometry(32, 4, 128, 16, "full", num_layers=8),
    # z-lab/gpt-oss-20b-DFlash config.json
    "gpt-oss-20b-dflash": Geometry(64, 8, 64, 8, "full", num_layers=8),
    # z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat config.json (block_size 10)
    "llama3.1-8b-dflash": Geometry(32, 8, 128, 10, "full", num_layers=5),
    # z-lab/Qwen3.5-122B-A10B-DFlash config.json (sliding_window 4096, non-causal)
    "qwen3.5-122b-dflash": Geometry(32, 8, 128, 16, "sliding", 4096, num_layers=6),
    # z-lab DFlash2 drafters' config.json (e.g. z-lab/Qwen3.8-27B-DFlash2; sliding_window 2048)
    "dflash2-w2048": Geometry(32, 8, 128, 16, "sliding", 2048, num_layers=5),
    # XiaomiMiMo/MiMo-V2.5-DFlash, dflash/config.json (64 Q / 8 KV heads, sliding_window 1024)
    "mimo-dflash": Geometry(64, 8, 128, 8, "sliding", 1024, num_layers=5),
    # poolside Laguna DFlash drafter config.json (72 Q / 8 KV heads: group 9; causal window 512)
    "laguna-dflash": Geometry(72, 8, 128, 16, "sliding_causal", 512, num_layers=6),
}


def get_preset(name: str) -> Geometry:
    """The Geometry of a named drafter (a key of PRESETS); ValueError listing the known names
    otherwise.

    >>> get_preset("laguna-dflash").group
    9
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
