"""Each module's own word that it is a decoder: a bool `is_decoder` attribute of a module of the program's own class.

A hand-written port of a BERT-family or T5 model keeps `self.is_decoder = True` on the decoder's blocks (T5's
`T5Block(is_decoder=True)`, with cross-attention beside it) and an embedding wrapper of a causal LM keeps it on itself
(MNN's export reads `model.is_decoder` to choose the causal mask path): the module's self-attention is then causal
(checks/decoders.py reads it as a config's `is_decoder=True`); `False` (an encoder's block) says the calls under it are
no decoder's. Read once per outermost module with the configs (trace/stated.py), for the calls at or under the module
that holds it; not on transformers' or torch's own classes (their configs say it: checks/intent.py), nor where the
module says it is a whole encoder-decoder (`is_encoder_decoder = True`).
"""

from __future__ import annotations


def own_decoders(root, path) -> list:
    """Stated({"causal_decoder": bool, "own": True}) per module of the program's own class holding a bool is_decoder."""
    from maskcli.checks.intent import Stated
    from maskcli.trace.builders import _own_flag

    found = []
    for module in root.modules():
        scope = path(module)
        flag = None if scope is None else _own_flag(module)
        if flag is None or flag and vars(module).get("is_encoder_decoder") is True:
            continue
        found.append(Stated(f"self.is_decoder={flag} of {scope or type(module).__name__}", scope,
                            {"causal_decoder": flag, "own": True}))
    return found
