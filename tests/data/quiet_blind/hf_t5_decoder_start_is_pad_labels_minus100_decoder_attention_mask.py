"""T5 fine-tuning batch: decoder_start_token_id == pad_token_id == 0, labels padded with -100, then greedy decoding.

Follows huggingface/transformers src/transformers/models/t5/modeling_t5.py (``T5PreTrainedModel._shift_right``:
prepend ``decoder_start_token_id`` and replace -100 by ``pad_token_id``) and
src/transformers/data/data_collator.py ``DataCollatorForSeq2Seq`` (source padded with the tokenizer's pad id and an
``attention_mask``, labels padded with ``label_pad_token_id=-100``, ``decoder_input_ids`` from
``model.prepare_decoder_input_ids_from_labels``). T5ForConditionalGeneration is built from a small T5Config with
random weights.

Masks meant: encoder self-attention and cross-attention hide each row's padded SOURCE keys (from attention_mask).
Decoder self-attention is causal; its padding mask is built from the LABELS (``labels != -100`` shifted right, and
always 1 for the start slot), not from ``decoder_input_ids != pad``: position 0 holds id 0 = pad, yet it is the
real start token every target position must see. Padded label slots are hidden as keys and ignored in the loss.
"""
import torch
from transformers import T5Config, T5ForConditionalGeneration

PAD = 0
EOS = 1


def collate(features):
    """DataCollatorForSeq2Seq, right padding (T5 tokenizers pad on the right)."""
    max_src = max(len(f["input_ids"]) for f in features)
    max_lbl = max(len(f["labels"]) for f in features)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    for f in features:
        n, m = len(f["input_ids"]), len(f["labels"])
        batch["input_ids"].append(f["input_ids"] + [PAD] * (max_src - n))
        batch["attention_mask"].append([1] * n + [0] * (max_src - n))
        batch["labels"].append(f["labels"] + [-100] * (max_lbl - m))
    return {k: torch.tensor(v) for k, v in batch.items()}


def main():
    torch.manual_seed(0)
    config = T5Config(vocab_size=48, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=EOS,
                      decoder_start_token_id=PAD)
    model = T5ForConditionalGeneration(config).eval()

    features = [
        {"input_ids": [5, 6, 7, EOS], "labels": [20, 21, 22, 23, 24, 25, EOS]},      # target longer than source
        {"input_ids": [8, 9, 10, 11, 12, 13, 14, 15, 16, EOS], "labels": [26, EOS]},  # target much shorter
        {"input_ids": [17, 18, EOS], "labels": [27, 28, 29, EOS]},
    ]
    batch = collate(features)
    labels = batch["labels"]
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    assert decoder_input_ids[:, 0].eq(PAD).all()  # the start token is the pad id
    decoder_attention_mask = torch.cat([torch.ones_like(labels[:, :1]), labels[:, :-1].ne(-100).long()], dim=1)

    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_attention_mask, labels=labels)
        assert torch.isfinite(out.loss)
        # Reference: each example alone, no padding on either side: same logits on its real target positions.
        for i, f in enumerate(features):
            lbl = torch.tensor([f["labels"]])
            alone = model(input_ids=torch.tensor([f["input_ids"]]), labels=lbl).logits[0]
            assert torch.allclose(out.logits[i, : lbl.shape[1]], alone, atol=1e-4), i

        generated = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                   suppress_tokens=[PAD])  # random weights favour id 0; keep the test informative
        assert generated[:, 0].eq(PAD).all()
        for i, f in enumerate(features):
            alone = model.generate(input_ids=torch.tensor([f["input_ids"]]), max_new_tokens=5, min_new_tokens=5,
                                   do_sample=False, suppress_tokens=[PAD])
            assert torch.equal(generated[i], alone[0]), i
    print(f"loss {out.loss.item():.3f}; greedy {generated.tolist()}")


if __name__ == "__main__":
    main()
