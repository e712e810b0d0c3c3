"""KerasNLP GPT2CausalLM.generate_step, ported from Keras/TF to plain torch at tiny sizes.

Citation: keras-team/keras-hub (then keras-nlp) PR #1029, "Fix a bug with computing the output mask after
generate" (merged 2023-05-11; PR description and review thread read, diff not read).

generate_step builds the output padding mask from the first stop token each row sampled after its prompt:
`overflow = tf.math.cumsum(end_locations, exclusive=True)` with no axis, so the running sum went down the batch
axis (axis 0), not along each row's tokens. A row's tokens after its end token stayed in the mask, and a row
lost a token wherever an earlier row had ended. The fix passes `axis=-1`. The mask is returned with the token
ids; the preprocessor strips tokens by it and `score()` hands it to the backbone as the padding mask.
"""
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)
config = GPT2Config(vocab_size=12, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=2)
backbone = GPT2LMHeadModel(config).eval()
END_TOKEN_ID = 2
PAD_TOKEN_ID = 0


def preprocess(prompts, sequence_length):
    # GPT2CausalLMPreprocessor.generate_preprocess: StartEndPacker packs right padded, no end token appended.
    token_ids = torch.full((len(prompts), sequence_length), PAD_TOKEN_ID, dtype=torch.long)
    padding_mask = torch.zeros((len(prompts), sequence_length), dtype=torch.bool)
    for i, p in enumerate(prompts):
        token_ids[i, : len(p)] = torch.tensor(p)
        padding_mask[i, : len(p)] = True
    return {"token_ids": token_ids, "padding_mask": padding_mask}


def top_k_sampler(next, prompt, index, mask, end_token_id, k=5):
    # keras_nlp.samplers.Sampler.__call__: fill every slot the prompt mask leaves free, stop once every row
    # has produced end_token_id after its prompt.
    max_length = prompt.shape[1]
    generator = torch.Generator().manual_seed(1234)
    while index < max_length:
        logits = next(prompt, index)
        top = torch.topk(logits, k, dim=-1)
        probs = torch.softmax(top.values, dim=-1)
        choice = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        next_token = top.indices.gather(-1, choice[:, None]).squeeze(-1)
        next_token = torch.where(mask[:, index], prompt[:, index], next_token)
        prompt = prompt.clone()
        prompt[:, index] = next_token
        index += 1
        end_seen = ((prompt == end_token_id) & ~mask).any(dim=-1)
        if bool(end_seen.all()):
            break
    return prompt


@torch.no_grad()
def generate_step(inputs, end_token_id=None):
    token_ids, padding_mask = inputs["token_ids"], inputs["padding_mask"]
    row_lengths = padding_mask.int().sum(dim=-1)
    index = int(row_lengths.min())

    def next(prompt, index):
        # call_with_cache on the token before `index`; causal, so the same logits as the cached step.
        return backbone(input_ids=prompt[:, :index]).logits[:, -1, :]

    token_ids = top_k_sampler(next, token_ids, index, padding_mask, end_token_id)

    # Compute an output padding mask with the token ids we updated.
    if end_token_id is not None:
        # Build a mask of `end_token_id` locations not in the original
        # prompt (not in locations where `padding_mask` is True).
        end_locations = (token_ids == end_token_id) & ~padding_mask
        end_locations = end_locations.int()
        # Use cumsum to get ones in all locations after end_locations.
        if FIXED:
            overflow = torch.cumsum(end_locations, dim=-1) - end_locations
        else:
            overflow = torch.cumsum(end_locations, dim=0) - end_locations  # tf.math.cumsum(x, exclusive=True)
        # Our padding mask is the inverse of these overflow locations.
        padding_mask = ~overflow.bool()
    else:
        padding_mask = torch.ones_like(token_ids, dtype=torch.bool)
    return {"token_ids": token_ids, "padding_mask": padding_mask}


def generate_postprocess(outputs):
    # GPT2CausalLMPreprocessor.generate_postprocess: keep only the tokens under the padding mask.
    return [row[m].tolist() for row, m in zip(outputs["token_ids"], outputs["padding_mask"])]


@torch.no_grad()
def score(token_ids, padding_mask):
    # GPT2CausalLM.score(scoring_mode="loss"): the backbone runs under the padding mask, per-token loss on
    # the next token, averaged over the masked targets of each row.
    logits = backbone(input_ids=token_ids, attention_mask=padding_mask.long()).logits
    targets = token_ids[:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), targets, reduction="none"
    )
    weights = padding_mask[:, 1:].float()
    return (loss * weights).sum(-1) / weights.sum(-1)


prompts = [[1, 5, 7], [1, 4], [1, 9, 3, 6], [1, 8]]
inputs = preprocess(prompts, sequence_length=14)
outputs = generate_step(inputs, end_token_id=END_TOKEN_ID)
texts = generate_postprocess(outputs)
for t in texts:
    print(t)
print("per-sample loss:", [round(x, 4) for x in score(outputs["token_ids"], outputs["padding_mask"]).tolist()])
