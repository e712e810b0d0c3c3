"""BART teacher-forced training where the source is shorter than the target.

Follows huggingface/transformers src/transformers/models/bart/modeling_bart.py
(BartForConditionalGeneration.forward: decoder_input_ids = shift_tokens_right(labels,
pad, decoder_start_token_id); the encoder's `attention_mask` is passed on to the
decoder's cross-attention as `encoder_attention_mask`; labels -100 on target padding)
as used for expansion tasks such as keyword-to-sentence / data-to-text, not pinned.
Sources of 2-5 tokens are right-padded to 5; targets of 6-11 tokens right-padded to
11, so the decoder is longer than the memory it reads. decoder_attention_mask hides
target padding; the cross-attention hides source padding. Reference: every pair
alone, unpadded, its per-token loss and logits compared.
"""
import torch
from transformers import BartConfig, BartForConditionalGeneration
from transformers.models.bart.modeling_bart import shift_tokens_right

torch.manual_seed(0)
cfg = BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=2,
                 encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                 pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                 dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
model = BartForConditionalGeneration(cfg).eval()
PAD, BOS, EOS = 1, 0, 2


def wrap(t):
    return torch.cat([torch.tensor([BOS]), t, torch.tensor([EOS])])


sources = [wrap(torch.randint(3, 64, (n,))) for n in (3, 0, 1)]      # 5, 2, 3 tokens
targets = [wrap(torch.randint(3, 64, (n,))) for n in (9, 4, 6)]      # 11, 6, 8 tokens
S, T = max(map(len, sources)), max(map(len, targets))
input_ids = torch.full((3, S), PAD)
labels = torch.full((3, T), -100)
for i, (s, t) in enumerate(zip(sources, targets)):
    input_ids[i, :len(s)] = s
    labels[i, :len(t)] = t
attention_mask = (input_ids != PAD).long()
decoder_input_ids = shift_tokens_right(labels, PAD, cfg.decoder_start_token_id)
decoder_attention_mask = (labels != -100).long()
decoder_attention_mask[:, 0] = 1                           # the start token is real

with torch.no_grad():
    out = model(input_ids=input_ids, attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
                decoder_attention_mask=decoder_attention_mask)
    logp = out.logits.log_softmax(-1)
    tok_loss = -logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)

    worst = 0.0
    for i, (s, t) in enumerate(zip(sources, targets)):
        lab = t[None]
        o = model(input_ids=s[None], labels=lab)
        ref_lp = o.logits.log_softmax(-1)
        ref_tok = -ref_lp.gather(-1, lab[..., None]).squeeze(-1)[0]
        worst = max(worst, (ref_tok - tok_loss[i, :len(t)]).abs().max().item())
        worst = max(worst, (o.logits[0] - out.logits[i, :len(t)]).abs().max().item())
        worst = max(worst, abs(o.loss.item() - tok_loss[i, :len(t)].mean().item()))

print("source lengths", [len(s) for s in sources], "target lengths", [len(t) for t in targets])
print(f"padded batch vs one pair at a time, max diff {worst:.2e}")
assert worst < 1e-4
