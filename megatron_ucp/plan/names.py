"""Parameter names of Megatron-DeepSpeed's two GPT models, mapped onto each other (pure).

AuroraGPT trains the non-pipeline ``GPTModel`` (``--no-pipeline-parallel``), whose parameters are
``language_model.encoder.layers.<i>.<rest>``; the pipeline model ``GPTModelPipe`` (any PP > 1) names
them by position in its layer list, ``<i + first>.<rest>``, with the embedding, the final norm and
the output head as layers of their own. A checkpoint saved by one model is loaded into the other
through :func:`name_map`, which puts both sides in one canonical form (embedding, layer ``i``,
final norm, output head) and pairs them, or says which names it cannot pair.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

from megatron_ucp.errors import PlanError

_NONPIPE = re.compile(
    r"^language_model\.(?:(?P<emb>embedding)\.(?P<emb_rest>.+)|encoder\.layers\.(?P<layer>\d+)\."
    r"(?P<layer_rest>.+)|encoder\.final_layernorm\.(?P<norm_rest>.+)|output_layer\.(?P<out_rest>.+))$"
)
_PIPE = re.compile(r"^(?P<index>\d+)\.(?P<rest>.+)$")
_TIED = "tied_modules.embed."
_EMBEDDING_ATTRS = ("word_embeddings.", "position_embeddings.", "tokentype_embeddings.")
_LAYER_ATTRS = ("self_attention.", "mlp.", "input_layernorm.", "post_attention_layernorm.")

Canonical = tuple


def is_pipeline_names(names: Iterable[str]) -> bool:
    """Whether the names are ``GPTModelPipe``'s (layer-indexed) rather than ``GPTModel``'s."""
    names = list(names)
    return bool(names) and all(_PIPE.match(n) or n.startswith(_TIED) for n in names)


def _canonical_nonpipe(names: Iterable[str]) -> dict[str, Canonical]:
    out = {}
    for name in names:
        m = _NONPIPE.match(name)
        if m is None:
            raise PlanError(f"{name!r} is not a parameter name of Megatron-DeepSpeed's GPTModel")
        if m.group("emb"):
            out[name] = ("embedding", m.group("emb_rest"))
        elif m.group("layer") is not None:
            out[name] = ("layer", int(m.group("layer")), m.group("layer_rest"))
        elif m.group("norm_rest") is not None:
            out[name] = ("final_norm", m.group("norm_rest"))
        else:
            out[name] = ("output", m.group("out_rest"))
    return out


def _canonical_pipe(names: Iterable[str]) -> dict[str, Canonical]:
    names = list(names)
    layers = sorted(
        {
            int(_PIPE.match(n).group("index"))
            for n in names
            if _PIPE.match(n) and _PIPE.match(n).group("rest").startswith(_LAYER_ATTRS)
        }
    )
    if not layers:
        raise PlanError("no transformer layer among the pipeline model's parameter names")
    first, last = layers[0], layers[-1]
    if layers != list(range(first, last + 1)):
        raise PlanError(
            f"the pipeline model's transformer layers are not consecutive ({layers[:6]}...): the names "
            "of one pipeline stage only?"
        )
    out = {}
    for name in names:
        if name.startswith(_TIED):
            out[name] = ("embedding", name[len(_TIED) :])
            continue
        m = _PIPE.match(name)
        if m is None:
            raise PlanError(f"{name!r} is not a parameter name of Megatron-DeepSpeed's GPTModelPipe")
        index, rest = int(m.group("index")), m.group("rest")
        if rest.startswith(_EMBEDDING_ATTRS) and index < first:
            out[name] = ("embedding", rest)
        elif first <= index <= last:
            out[name] = ("layer", index - first, rest)
        elif rest.startswith("lm_head."):
            out[name] = ("output", rest[len("lm_head.") :])
        elif index > last and "." not in rest:
            out[name] = ("final_norm", rest)
        else:
            raise PlanError(f"{name!r}: cannot tell which part of the GPT model it is")
    return out


def canonical_names(names: Iterable[str]) -> dict[str, Canonical]:
    names = list(names)
    return _canonical_pipe(names) if is_pipeline_names(names) else _canonical_nonpipe(names)


def _canonical_where_known(params: Iterable[str], others: Iterable[str]) -> dict[str, Canonical]:
    """Canonical forms of ``others`` (buffers, frozen tensors) in the scheme of ``params``; names the
    scheme does not know (``language_model.rotary_pos_emb.inv_freq``) are left out."""
    params = list(params)
    out = {}
    for name in others:
        try:
            out.update({k: v for k, v in canonical_names([*params, name]).items() if k == name})
        except PlanError:
            continue
    return out


def counterpart_names(
    names: Iterable[str], live_params: Iterable[str], saved_params: Iterable[str], saved: Iterable[str]
) -> dict[str, str]:
    """Live module tensors (buffers) -> the name the other GPT model class saved the same tensor
    under, for the names both schemes know; the parameter names of each side fix its scheme (and
    the pipeline model's first layer index)."""
    saved = list(saved)
    live_c = _canonical_where_known(live_params, names)
    by_canonical = {c: n for n, c in _canonical_where_known(saved_params, saved).items()}
    return {name: by_canonical[c] for name, c in live_c.items() if c in by_canonical}


def name_map(live: Iterable[str], saved: Iterable[str]) -> Optional[dict[str, str]]:
    """Live parameter name -> the saved name holding its state; None when no map is needed (the live
    names are all saved names). Raises :class:`PlanError` naming what cannot be paired."""
    live, saved = sorted(set(live)), sorted(set(saved))
    if set(live) <= set(saved):
        return None
    live_c, saved_c = canonical_names(live), canonical_names(saved)
    by_canonical = {c: name for name, c in saved_c.items()}
    if len(by_canonical) != len(saved_c):
        raise PlanError("two saved parameters map to the same part of the model")
    out, unpaired = {}, []
    for name, c in live_c.items():
        if c in by_canonical:
            out[name] = by_canonical[c]
        else:
            unpaired.append(name)
    if unpaired:
        raise PlanError(
            f"live parameters without a saved counterpart: {unpaired[:5]}{' ...' if len(unpaired) > 5 else ''}"
        )
    extra = sorted(set(saved) - set(out.values()))
    if extra:
        raise PlanError(f"saved parameters without a live counterpart: {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    return out
