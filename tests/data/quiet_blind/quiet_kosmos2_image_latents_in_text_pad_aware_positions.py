"""Kosmos-2: an image's resampled latents spliced into the text at `image_embeds_position_mask`,
batched with the processor's padding (right for training, left for generation).

Port of huggingface/transformers v5.25.0 (the installed version):
  src/transformers/models/kosmos2/processing_kosmos2.py  Kosmos2Processor.__call__: `<s> <image>
      [latent_query_num image-token ids] </image> text`, image_embeds_position_mask
      `[0] + [0] + [1] * num_image_tokens + [0]` then zeros, and rows padded by hand with pad_token_id
      (ids), 0 (position mask) and 0 (attention_mask) on the tokenizer's padding_side;
  src/transformers/models/kosmos2/modeling_kosmos2.py    Kosmos2ForConditionalGeneration (vision model ->
      Kosmos2ImageToTextProjection: latent queries cross-attending the patch features -> image_embeds),
      Kosmos2TextTransformer.forward_embedding (image_embeds written where the position mask is 1),
      Kosmos2TextSinusoidalPositionalEmbedding.create_position_ids_from_input_ids (fairseq's
      make_positions: pads keep padding_idx, real tokens count from padding_idx + 1), the causal +
      padding decoder mask.
The model is built from a tiny Kosmos2Config with random weights; the tokenizer is a toy id table
(bos 0, pad 1, eos 2, as Kosmos-2's). The decode loop after the prefill is written by hand, one token
per step with the cache, handing the text model the next token's position the same make_positions way
over the whole sequence so far (pads do not count), and the attention_mask grown by one column.
Checked against each sample run alone, unpadded and without a mask: the logits at every real position
of the right-padded and of the left-padded batch, the training loss with pad labels at -100, and the
greedy tokens and their logits of the left-padded decode against a full no-cache forward of each
sample's prompt + tokens so far.
"""
import torch
import torch.nn.functional as F
from transformers import Kosmos2Config, Kosmos2ForConditionalGeneration

torch.manual_seed(0)

BOS, PAD, EOS, BOI, EOI = 0, 1, 2, 3, 4
LATENT_QUERY_NUM = 4
FIRST_IMAGE_TOKEN_ID = 5
WORDS = {w: i for i, w in enumerate("<grounding> an image of a snowman warming himself by fire two dogs".split(),
                                    start=FIRST_IMAGE_TOKEN_ID + LATENT_QUERY_NUM)}
VOCAB = FIRST_IMAGE_TOKEN_ID + LATENT_QUERY_NUM + len(WORDS) + 3


def tokenize(text):
    return [BOS] + [BOI] + [0] * LATENT_QUERY_NUM + [EOI] + [WORDS[w] for w in text.split()]


def processor(texts, padding_side, num_image_tokens=LATENT_QUERY_NUM):
    """Kosmos2Processor.__call__'s id rewrite, position mask and padding (add_special_tokens=True)."""
    with_bos = True
    start_index = int(with_bos) + 1
    image_token_ids = list(range(FIRST_IMAGE_TOKEN_ID, FIRST_IMAGE_TOKEN_ID + num_image_tokens))
    base_image_embeds_position_mask = [0] + [1] * num_image_tokens + [0]

    input_ids, image_embeds_position_mask, attention_mask = [], [], []
    for text in texts:
        text_ids = tokenize(text)
        text_ids = text_ids[:start_index] + image_token_ids + text_ids[start_index + num_image_tokens:]
        input_ids.append(text_ids)
        attention_mask.append([1] * len(text_ids))
        mask = list(base_image_embeds_position_mask)
        if with_bos:
            mask = [0] + mask
        mask += [0] * (len(text_ids) - len(mask))
        image_embeds_position_mask.append(mask)

    max_len_padded = max(len(x) for x in input_ids)
    if padding_side == "right":
        input_ids = [x + [PAD] * (max_len_padded - len(x)) for x in input_ids]
        image_embeds_position_mask = [x + [0] * (max_len_padded - len(x)) for x in image_embeds_position_mask]
        attention_mask = [x + [0] * (max_len_padded - len(x)) for x in attention_mask]
    elif padding_side == "left":
        input_ids = [[PAD] * (max_len_padded - len(x)) + x for x in input_ids]
        image_embeds_position_mask = [[0] * (max_len_padded - len(x)) + x for x in image_embeds_position_mask]
        attention_mask = [[0] * (max_len_padded - len(x)) + x for x in attention_mask]
    return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask),
            "image_embeds_position_mask": torch.tensor(image_embeds_position_mask)}


def make_positions(input_ids, padding_idx):
    mask = input_ids.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


@torch.no_grad()
def greedy_decode(model, pixel_values, inputs, max_new_tokens=5):
    out = model(pixel_values=pixel_values, input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                image_embeds_position_mask=inputs["image_embeds_position_mask"], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    ids = inputs["input_ids"]
    attention_mask = inputs["attention_mask"]
    next_logits = out.logits[:, -1]
    tokens, step_logits = [], []
    for _ in range(max_new_tokens):
        nxt = next_logits.argmax(-1)
        tokens.append(nxt)
        step_logits.append(next_logits)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=1)
        position_ids = make_positions(ids, model.config.text_config.pad_token_id)[:, -1:]
        step = model.text_model(input_ids=nxt[:, None], attention_mask=attention_mask, cache=cache,
                                position_ids=position_ids, use_cache=True)
        cache = step.cache if hasattr(step, "cache") else step.past_key_values
        next_logits = step.logits[:, -1]
    return torch.stack(tokens, 1), torch.stack(step_logits, 1)


def main():
    config = Kosmos2Config(
        text_config=dict(vocab_size=VOCAB, embed_dim=32, layers=2, ffn_dim=64, attention_heads=4,
                         max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, init_std=0.1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           image_size=16, patch_size=8),
        latent_query_num=LATENT_QUERY_NUM,
    )
    model = Kosmos2ForConditionalGeneration(config).eval()
    torch.set_grad_enabled(False)

    texts = ["<grounding> an image of a snowman warming himself by fire", "<grounding> two dogs"]
    pixel_values = torch.randn(2, 3, 16, 16)

    # each sample alone: no padding, no attention_mask
    alone = []
    for i, t in enumerate(texts):
        one = processor([t], "right")
        assert one["attention_mask"].all()
        logits = model(pixel_values=pixel_values[i:i + 1], input_ids=one["input_ids"],
                       image_embeds_position_mask=one["image_embeds_position_mask"]).logits[0]
        alone.append((one, logits))

    for side in ("right", "left"):
        batch = processor(texts, side)
        # training labels (right padding): the pads' labels at -100; the model shifts them inside
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100) if side == "right" else None
        out = model(pixel_values=pixel_values, labels=labels, **batch)
        tot, n = 0.0, 0
        for i, (one, ref) in enumerate(alone):
            real = batch["attention_mask"][i].bool()
            assert torch.equal(batch["input_ids"][i, real], one["input_ids"][0])
            torch.testing.assert_close(out.logits[i, real], ref, atol=1e-5, rtol=1e-5)
            tot += F.cross_entropy(ref[:-1], one["input_ids"][0, 1:], reduction="sum")
            n += ref.shape[0] - 1
        if side == "right":
            torch.testing.assert_close(out.loss, tot / n, atol=1e-5, rtol=1e-5)

    batch = processor(texts, "left")
    tokens, step_logits = greedy_decode(model, pixel_values, batch)
    for i, (one, _) in enumerate(alone):
        ids = one["input_ids"]
        for s in range(tokens.shape[1]):
            pos_mask = F.pad(one["image_embeds_position_mask"], (0, ids.shape[1] - one["image_embeds_position_mask"].shape[1]))
            ref = model(pixel_values=pixel_values[i:i + 1], input_ids=ids, image_embeds_position_mask=pos_mask,
                        use_cache=False).logits[0, -1]
            torch.testing.assert_close(step_logits[i, s], ref, atol=1e-4, rtol=1e-4)
            assert int(tokens[i, s]) == int(ref.argmax())
            ids = torch.cat([ids, tokens[i:i + 1, s:s + 1]], dim=1)
    print("generated", tokens.tolist())
    print("ok")


if __name__ == "__main__":
    main()
