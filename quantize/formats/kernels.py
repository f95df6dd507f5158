"""Which of vLLM's 4-bit CUDA kernels takes a linear of a given shape and group size, walked in vLLM's own order
(marlin_utils and the mixed-precision kernel list, checked on 0.26 and 0.32): the rules each Format's
`cuda_kernel` and pre-flight's deployability table apply. No torch: recipe validation reads them.
"""

from __future__ import annotations

# vLLM's Marlin kernels (marlin_utils, checked 0.26 and 0.32): these group sizes; a tile-misaligned shape is zero-padded
# at weight preparation, so only a quantization group split between two GPUs stops Marlin
MARLIN_GROUPS = (-1, 32, 64, 128)
MACHETE_GROUPS, MACHETE_TILE = (-1, 64, 128), (64, 128)  # Hopper only: group sizes, (in, out) tile
TRITON_W4A16_GROUPS = (-1, 32, 64, 128, 256)
# tiers of a kernel (deploy.py): Marlin-class, a slower fallback, or vLLM refuses the layer
MARLIN, FALLBACK, REFUSED = "marlin", "fallback", "refused"


def marlin_misfit(in_f: int, in_pp: int, group: int) -> str:
    """Why Marlin cannot take a linear with in_f inputs, in_pp of them on each GPU; "" when it can."""
    if group not in MARLIN_GROUPS:
        return f"group size {group} is not one of Marlin's {list(MARLIN_GROUPS)}"
    if group != -1 and group < in_f and in_pp % group:
        return f"in_features per GPU {in_pp} is not a multiple of group size {group} (a group would span two GPUs)"
    return ""


def _mp_kernel(in_f: int, in_pp: int, out_pp: int, group: int, zero_points: bool, cc: int, dtype: str,
               exllama: bool) -> tuple[str, str, str]:
    """vLLM's mixed-precision kernel list for 4-bit weights on CUDA, walked in its order -> (tier, kernel, why)."""
    if cc == 90 and group in MACHETE_GROUPS and in_pp % MACHETE_TILE[0] == 0 and out_pp % MACHETE_TILE[1] == 0:
        return MARLIN, "Machete", ""
    why = marlin_misfit(in_f, in_pp, group)
    if not why:
        return MARLIN, "Marlin", ""
    if exllama and dtype == "float16" and out_pp % 8 == 0 and group > 0 and in_f % group == 0:
        return FALLBACK, "Exllama", why
    g = in_pp if group == -1 else group
    if out_pp % 8 == 0 and (group in TRITON_W4A16_GROUPS or group == in_f) and in_pp % g == 0:
        return FALLBACK, "Triton W4A16", why
    return REFUSED, "", f"{why}, and no other 4-bit kernel takes it{' in ' + dtype if exllama else ''}"


def moe_marlin_misfit(hidden: int, inter_pp: int, group: int) -> str:
    """Why vLLM's Marlin MoE kernel cannot take experts of this shape (intermediate size per GPU); "" if it can."""
    if group not in MARLIN_GROUPS:
        return f"group size {group} is not one of Marlin's {list(MARLIN_GROUPS)}"
    if hidden % 128:
        return f"hidden size {hidden} is not a multiple of 128"
    if group > 0 and inter_pp % group:
        return f"expert intermediate size per GPU {inter_pp} is not a multiple of group size {group}"
    return ""
