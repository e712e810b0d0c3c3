"""false_alarms_modes.py's encoder-decoder and vision-language runs: tiny configs (maskcli.hf.families' sizes, and the
names these families give their encoder's and decoder's sizes), padded input, generate, traced; never a download.

A vision-language batch is built as the family's processor would build it, without one: a random image of the
vision config's size, and the image token repeated as many times as the model's image features count (read from the
model's own refusal of one token: "tokens: 1, features: N"), after left padding and before the text.
"""

from __future__ import annotations

import inspect
import re

import torch

from false_alarms_modes import MOVES, moved, other_id

# the names encoder-decoder and vision configs give their sizes (maskcli.hf.families.SIZES covers the text config's)
SEQ2SEQ = {"d_model": 32, "d_ff": 64, "d_kv": 16, "num_heads": 2, "num_layers": 2, "num_decoder_layers": 2,
           "encoder_layers": 2, "decoder_layers": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
           "encoder_attention_heads": 2, "decoder_attention_heads": 2, "vocab_size": 128}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, "depth": 2,
          "embed_dim": 32, "num_heads": 2, "projection_dim": 32}
FEATURES = re.compile(r"features:? (\d+)")


def families(mode: str) -> list[str]:
    from transformers.models.auto import modeling_auto as auto

    table = auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES if mode == "seq2seq" else auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    return sorted(table)


def runs(mode: str, name: str) -> list:
    if mode == "seq2seq":
        return [(f"{attn} {side}", lambda attn=attn, side=side: seq2seq(name, attn, side))
                for attn in ("sdpa", "eager") for side in ("right", "left")]
    return [("sdpa", lambda: vlm(name, "sdpa"))]


def _set(config, sizes: dict) -> None:
    for key, value in sizes.items():
        if getattr(config, key, None) is not None:
            setattr(config, key, value)


def _built(auto_class, config, attn: str, name: str):
    from maskcli.errors import MaskError
    from maskcli.hf.families import MOST_PARAMETERS

    with torch.device("meta"):
        count = sum(p.numel() for p in auto_class.from_config(config, attn_implementation=attn).parameters())
    if count > MOST_PARAMETERS:
        raise MaskError(f"{name} does not shrink: {count:,} parameters")
    torch.manual_seed(0)
    return auto_class.from_config(config, attn_implementation=attn).eval()


def seq2seq(name: str, attn: str, side: str):
    """generate on an encoder input of rows 5 and 3 tokens padded on `side`, 3 new tokens; checked by the padding's
    ids changed (the generated logits move: the model attends to the encoder's padding)."""
    import transformers
    from maskcli.hf.families import tiny

    config = transformers.AutoConfig.for_model(name)
    tiny(config, name=name)
    _set(config, SEQ2SEQ)
    for part in ("encoder", "decoder"):  # (EncoderDecoderConfig holds two configs)
        if getattr(config, part, None) is not None and hasattr(getattr(config, part), "hidden_size"):
            tiny(getattr(config, part), name=name)
    model = _built(transformers.AutoModelForSeq2SeqLM, config, attn, name)
    vocab = model.config.get_text_config(decoder=True).vocab_size if hasattr(model.config, "get_text_config") else 128
    pad = model.config.pad_token_id if isinstance(model.config.pad_token_id, int) else 0
    rows = [[other_id({pad}, vocab, t) for t in (3, 4, 5, 6, 7)], [other_id({pad}, vocab, t) for t in (20, 21, 22)]]
    real = [1] * 3 + [0] * 2 if side == "right" else [0] * 2 + [1] * 3
    mask = torch.tensor([[1] * 5, real])

    start = getattr(model.config, "decoder_start_token_id", None)
    start = start if isinstance(start, int) and 0 <= start < vocab else pad

    def generated(fill: int):
        second = rows[1] + [fill] * 2 if side == "right" else [fill] * 2 + rows[1]
        with torch.no_grad():
            out = model.generate(torch.tensor([rows[0], second]), attention_mask=mask, max_new_tokens=3, min_new_tokens=3,
                                 do_sample=False, pad_token_id=pad, return_dict_in_generate=True, output_logits=True,
                                 decoder_start_token_id=start)
        return torch.stack(out.logits, 1)

    def check():
        base, other = generated(pad), generated(other_id({pad}, vocab, 50))
        return {"padding": moved(base, other)} if moved(base, other) > MOVES else {}
    return (lambda: generated(pad)), check


def vlm(name: str, attn: str):
    """generate on rows of [padding] image tokens and text, one image each, left-padded, 3 new tokens; checked by the
    padding's ids changed."""
    import transformers
    from maskcli.errors import MaskError
    from maskcli.hf.families import tiny

    config = transformers.AutoConfig.for_model(name)
    text = config.get_text_config()
    tiny(text, name=name)
    vision = getattr(config, "vision_config", None)
    if vision is None:
        raise MaskError(f"{name}: no vision_config")
    _set(vision, VISION)
    if getattr(vision, "out_hidden_size", None) is not None:
        vision.out_hidden_size = text.hidden_size
    for key in ("projector_hidden_size", "mm_hidden_size"):
        if getattr(config, key, None) is not None:
            setattr(config, key, text.hidden_size)
    patch = getattr(vision, "patch_size", None)
    if isinstance(patch, int) and isinstance(getattr(vision, "image_size", None), int):
        vision.image_size = 2 * patch  # (2 x 2 patches: Gemma 3's and PaliGemma's image token counts follow)
    for key in ("mm_tokens_per_image", "image_seq_length"):
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, 4)
    keys = [key for key in ("image_token_id", "image_token_index") if isinstance(getattr(config, key, None), int)]
    if not keys:
        raise MaskError(f"{name}: no image token id in its config")
    image_token = text.vocab_size - 3  # (inside the tiny vocabulary)
    for key in keys:
        setattr(config, key, image_token)
    model = _built(transformers.AutoModelForImageTextToText, config, attn, name)
    size = getattr(vision, "image_size", 28)
    size = size if isinstance(size, int) else size[0] if isinstance(size, (list, tuple)) else 28
    pad = text.pad_token_id if isinstance(text.pad_token_id, int) and text.pad_token_id != image_token else 0
    vocab = text.vocab_size
    torch.manual_seed(1)
    pixels = torch.randn(2, getattr(vision, "num_channels", 3), size, size)
    takes_types = "token_type_ids" in inspect.signature(model.forward).parameters

    def batch(count: int, fill: int) -> dict:
        words = [[other_id({pad, image_token}, vocab, t) for t in (3, 4, 5)], [other_id({pad, image_token}, vocab, t) for t in (20,)]]
        rows = [[image_token] * count + w for w in words]
        width = max(map(len, rows))
        ids = torch.tensor([[fill] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        found = {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}
        if takes_types:  # (Gemma 3's processor marks the image tokens: they attend to each other both ways)
            found["token_type_ids"] = (ids == image_token).long()
        return found

    count = _image_tokens(model, batch, pad, text.hidden_size)
    if count > 64:
        raise MaskError(f"{name}: {count} image tokens per image at image_size {size}")

    def generated(fill: int):
        with torch.no_grad():
            out = model.generate(**batch(count, fill), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=pad,
                                 return_dict_in_generate=True, output_logits=True)
        return torch.stack(out.logits, 1)

    def check():
        base, other = generated(pad), generated(other_id({pad, image_token}, vocab, 50))
        return {"padding": moved(base, other)} if moved(base, other) > MOVES else {}
    return (lambda: generated(pad)), check


def _image_tokens(model, batch, pad: int, hidden: int) -> int:
    """How many image tokens an image takes: the model's refusal of one ("features: N", for the batch's two images,
    counted in features or in their numbers) read, each reading tried."""
    try:
        with torch.no_grad():
            model(**batch(1, pad))
        return 1
    except Exception as error:  # noqa: BLE001 - the model's own word on how many image tokens it wants
        said = FEATURES.search(str(error))
        if said is None:
            raise
        features = int(said.group(1))
    for count in dict.fromkeys(n for n in (features // 2, features // (2 * hidden), features) if 0 < n <= 64):
        try:
            with torch.no_grad():
                model(**batch(count, pad))
            return count
        except Exception:  # noqa: BLE001 - not this reading: the next
            continue
    return features
