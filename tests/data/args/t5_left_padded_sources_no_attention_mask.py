"""A T5 batch of left-padded sources (pad id 0, the config's) fed with no attention_mask.

Written for checks/memory.py and checks/arguments.py another way than transformers-bart-pretrain#11 (BART, sources
right-padded by a tf.data-style `padded_batch`): transformers' T5ForConditionalGeneration from its config, the sources
left-padded by hand, `labels` given (the model shifts them into the decoder's inputs). Handed no mask, the encoder's
self-attention and the decoder's cross-attention attend the padding. `--fixed` hands the attention_mask
(`input_ids != pad_token_id`).
"""
import sys

import torch

FIXED = "--fixed" in sys.argv


def main():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=48, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                      pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, attn_implementation="eager")
    model = T5ForConditionalGeneration(config).eval()
    sources = [[5, 6, 7, 8, 9, 1], [10, 11, 1]]
    width = max(len(s) for s in sources)
    input_ids = torch.tensor([[config.pad_token_id] * (width - len(s)) + s for s in sources])
    labels = torch.tensor([[20, 21, 22, 1], [23, 24, 25, 1]])
    extra = {"attention_mask": (input_ids != config.pad_token_id).long()} if FIXED else {}
    with torch.no_grad():
        out = model(input_ids=input_ids, labels=labels, **extra)
    print("fixed" if FIXED else "buggy", round(float(out.loss), 4))


if __name__ == "__main__":
    main()
