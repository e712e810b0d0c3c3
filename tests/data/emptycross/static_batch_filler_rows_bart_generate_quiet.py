"""A static-shape batch filled up with rows of padding alone, summarized by BART, the filler rows' outputs dropped.

Written another way (tests/data/emptycross) beside quiet-r132b's Pop2Piano program (tests/data/quiet_blind: its feature
extractor puts an all-zero row after each clip): an inference server that compiles one batch shape fills a short
batch up to 4 rows with sequences of the pad id alone, `attention_mask` 0 throughout, runs transformers' BART (eager
attention: a finite fill) through `generate`, and keeps the real rows' summaries. The filler rows' decoder queries see
no encoder key; their output is padding's, dropped. Correct: each real row's summary equals its source run alone.
"""
import torch
from transformers import BartConfig, BartForConditionalGeneration

BATCH = 4


def collate(sources, pad_id):
    """Pad to the longest source, then fill the batch up to BATCH rows with padding alone."""
    width = max(map(len, sources))
    ids = [s + [pad_id] * (width - len(s)) for s in sources]
    mask = [[1] * len(s) + [0] * (width - len(s)) for s in sources]
    while len(ids) < BATCH:
        ids.append([pad_id] * width)
        mask.append([0] * width)
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}, len(sources)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    config = BartConfig(vocab_size=60, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                        forced_eos_token_id=None, attn_implementation="eager")
    model = BartForConditionalGeneration(config).eval()
    sources = [[0, 11, 23, 35, 17, 2], [0, 40, 8, 2]]
    batch, real = collate(sources, config.pad_token_id)
    out = model.generate(**batch, max_new_tokens=5, do_sample=False, num_beams=1)
    for row, source in enumerate(sources):
        ids = torch.tensor([source])
        alone = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                               num_beams=1)
        got = [t for t in out[row].tolist() if t != config.pad_token_id]
        assert got == [t for t in alone[0].tolist() if t != config.pad_token_id], (row, got, alone)
    print(f"{real} real rows of {BATCH}: summaries match each source alone; filler rows dropped")


if __name__ == "__main__":
    main()
