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
           "encoder_attention_heads": 2, "decoder_attention_heads": 2, "vocab_size": 128, "decoder_vocab_size": 128}
TOKENS = ("bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id")
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
                for attn in ("sdpa", "eager") for side in ("right", "left")] + \
            [(f"{attn} training", lambda attn=attn: seq2seq_training(name, attn)) for attn in ("sdpa", "eager")]
    import transformers

    found = [("sdpa", lambda: vlm(name, "sdpa"))]
    try:
        windowed = getattr(transformers.AutoConfig.for_model(name).get_text_config(), "sliding_window", None) is not None
    except Exception:  # noqa: BLE001 - (vlm says why, once)
        windowed = False
    if windowed:  # a window narrower than the image block (Gemma 3's sliding layers keep the block both ways)
        found.append(("sdpa window 3", lambda: vlm(name, "sdpa", window=3)))
    return found


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


def seq2seq_model(name: str, attn: str):
    import transformers
    from maskcli.hf.families import tiny

    config = transformers.AutoConfig.for_model(name)
    tiny(config, name=name)
    _set(config, SEQ2SEQ)
    for part in ("encoder", "decoder"):  # (EncoderDecoderConfig holds two configs)
        if getattr(config, part, None) is not None and hasattr(getattr(config, part), "hidden_size"):
            tiny(getattr(config, part), name=name)
    for key in TOKENS:  # a special token past the tiny vocabulary (Marian's 58100): one inside it
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= 128:
            setattr(config, key, 1)
    model = _built(transformers.AutoModelForSeq2SeqLM, config, attn, name)
    vocab = model.config.get_text_config(decoder=True).vocab_size if hasattr(model.config, "get_text_config") else 128
    pad = model.config.pad_token_id if isinstance(model.config.pad_token_id, int) else 0
    start = getattr(model.config, "decoder_start_token_id", None)
    return model, vocab, pad, start if isinstance(start, int) and 0 <= start < vocab else pad


def seq2seq(name: str, attn: str, side: str):
    """generate on an encoder input of rows 5 and 3 tokens padded on `side`, 3 new tokens; checked by the padding's
    ids changed (the generated logits move: the model attends to the encoder's padding)."""
    model, vocab, pad, start = seq2seq_model(name, attn)
    rows = [[other_id({pad}, vocab, t) for t in (3, 4, 5, 6, 7)], [other_id({pad}, vocab, t) for t in (20, 21, 22)]]
    real = [1] * 3 + [0] * 2 if side == "right" else [0] * 2 + [1] * 3
    mask = torch.tensor([[1] * 5, real])

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


def seq2seq_training(name: str, attn: str):
    """A training batch whose decoder is longer than its encoder input: encoder rows of 3 and 2 tokens right-padded,
    labels of 6 (the decoder's input their shift), use_cache=False, training mode; checked by the encoder's padding
    changed (row 1's logits move) and by the decoder's last input changed (an earlier position's logits move)."""
    model, vocab, pad, start = seq2seq_model(name, attn)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    labels = torch.tensor([[other_id({pad}, vocab, t) for t in range(30, 36)]] * 2)

    def logits(fill: int = pad, last: int | None = None, train: bool = False):
        ids = torch.tensor([[other_id({pad}, vocab, t) for t in (3, 4, 5)], [other_id({pad}, vocab, t) for t in (20, 21)] + [fill]])
        decoder = torch.cat([torch.full((2, 1), start), labels[:, :-1]], 1)
        if last is not None:
            decoder[:, -1] = last
        model.train(train)
        with torch.enable_grad() if train else torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder, labels=labels, use_cache=False).logits

    def check():
        base, other = logits(), logits(other_id({pad}, vocab, 50))
        later = logits(last=other_id({pad, int(labels[0, -2])}, vocab, 60))
        found = {}
        if moved(base[1], other[1]) > MOVES:
            found["padding"] = moved(base[1], other[1])
        if moved(base[:, :-1], later[:, :-1]) > MOVES:
            found["sees later"] = moved(base[:, :-1], later[:, :-1])
        return found
    return (lambda: logits(train=True)), check


def vlm(name: str, attn: str, window: int | None = None):
    """generate on rows of [padding] image tokens and text, one image each, left-padded, 3 new tokens; checked by the
    padding's ids changed, and by the last text token changed (an earlier position's logits move: it sees later)."""
    import transformers
    from maskcli.errors import MaskError
    from maskcli.hf.families import tiny

    config = transformers.AutoConfig.for_model(name)
    text = config.get_text_config()
    tiny(text, window=window, name=name)
    _mrope(text)
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
    # the tokens around an image (Qwen2-VL's rope index finds images by vision_start_token_id), inside the vocabulary
    around = [(key, text.vocab_size - 4 - i) for i, key in enumerate(("vision_start_token_id", "vision_end_token_id"))
              if isinstance(getattr(config, key, None), int)]
    for key, value in around:
        setattr(config, key, value)
    before, after = [v for k, v in around if k.endswith("start_token_id")], [v for k, v in around if k.endswith("end_token_id")]
    model = _built(transformers.AutoModelForImageTextToText, config, attn, name)
    size = getattr(vision, "image_size", 28)
    size = size if isinstance(size, int) else size[0] if isinstance(size, (list, tuple)) else 28
    pad = text.pad_token_id if isinstance(text.pad_token_id, int) and text.pad_token_id != image_token else 0
    vocab = text.vocab_size
    torch.manual_seed(1)
    taken = inspect.signature(model.forward).parameters
    channels = getattr(vision, "num_channels", getattr(vision, "in_channels", 3))
    pixels, extra = torch.randn(2, channels, size, size), {}
    if "image_grid_thw" in taken:  # Qwen2-VL's and its kin's: flattened patches, 4 x 4 per image (merged 2 x 2)
        patch, frames = getattr(vision, "patch_size", 14), getattr(vision, "temporal_patch_size", 2) or 1
        pixels = torch.randn(2 * 16, channels * frames * patch * patch)
        extra["image_grid_thw"] = torch.tensor([[1, 4, 4]] * 2)
    elif "image_sizes" in taken and getattr(config, "image_grid_pinpoints", None):  # LLaVA-NeXT's: each image's size
        extra["image_sizes"] = torch.tensor([[size, size]] * 2)
    takes_types = "token_type_ids" in taken
    held = {"pixels": pixels}  # (Idefics 3's and SmolVLM's take (B, images, C, H, W): _image_tokens says so)

    def batch(count: int, fill: int) -> dict:
        special = {pad, image_token, *before, *after}
        words = [[other_id(special, vocab, t) for t in (3, 4, 5)], [other_id(special, vocab, t) for t in (20,)]]
        rows = [before + [image_token] * count + after + w for w in words]
        width = max(map(len, rows))
        ids = torch.tensor([[fill] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        found = {"input_ids": ids, "attention_mask": mask, "pixel_values": held["pixels"], **extra}
        if takes_types:  # (Gemma 3's processor marks the image tokens: they attend to each other both ways)
            found["token_type_ids"] = (ids == image_token).long()
        if "mm_token_type_ids" in taken:  # (Qwen2-VL's processor: 1 on image tokens, for its multimodal RoPE)
            found["mm_token_type_ids"] = (ids == image_token).long()
        return found

    try:
        count = _image_tokens(model, batch, pad, text.hidden_size)
    except ValueError as error:
        if "expected 5, got 4" not in str(error):
            raise
        held["pixels"] = pixels[:, None]
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
        found = {"padding": moved(base, other)} if moved(base, other) > MOVES else {}
        given = batch(count, pad)
        with torch.no_grad():
            first = model(**given).logits
            given["input_ids"] = given["input_ids"].clone()
            given["input_ids"][:, -1] = other_id({pad, image_token, int(given["input_ids"][0, -1])}, vocab, 60)
            later = model(**given).logits
        if moved(first[:, :-1], later[:, :-1]) > MOVES:
            found["sees later"] = moved(first[:, :-1], later[:, :-1])
        return found
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


def _mrope(text) -> None:
    """Qwen2-VL's multimodal RoPE sections (rope_parameters' mrope_section, [16, 24, 24] for head_dim 128) scaled to
    the tiny head: they must sum to half of it."""
    half = (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) // 2
    for holder in (getattr(text, "rope_parameters", None), getattr(text, "rope_scaling", None)):
        sections = holder.get("mrope_section") if isinstance(holder, dict) else None
        if isinstance(sections, list) and sections and sum(sections) != half:
            scaled = [max(1, x * half // sum(sections)) for x in sections]
            scaled[-1] += half - sum(scaled)
            holder["mrope_section"] = scaled
