# Per-residue protein embeddings from a padded batch with no attention mask (the bug of agemagician/Ankh#24 written
# another way): an ESM-2 style batch converter (fair-esm's `alphabet.get_batch_converter()`: <cls> residues <eos>, right
# padding with `alphabet.padding_idx`) hands `tokens` positionally to transformers' EsmModel, so every residue of the
# shorter proteins attends to <pad>. The fix hands `attention_mask=tokens.ne(alphabet.padding_idx)`.
import sys

import torch
from transformers import EsmConfig, EsmModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Alphabet:
    """fair-esm's Alphabet, trimmed: <cls>=0, <pad>=1, <eos>=2, <unk>=3, residues after."""

    residues = "LAGVSERTIDPKQNFYMHWC"

    def __init__(self):
        self.cls_idx, self.padding_idx, self.eos_idx = 0, 1, 2
        self.tok_to_idx = {a: 4 + i for i, a in enumerate(self.residues)}

    def get_batch_converter(self):
        def convert(raw_batch):
            labels, strs = zip(*raw_batch)
            longest = max(len(s) for s in strs)
            tokens = torch.full((len(strs), longest + 2), self.padding_idx, dtype=torch.int64)
            for i, seq in enumerate(strs):
                tokens[i, 0] = self.cls_idx
                tokens[i, 1:len(seq) + 1] = torch.tensor([self.tok_to_idx[a] for a in seq])
                tokens[i, len(seq) + 1] = self.eos_idx
            return list(labels), list(strs), tokens
        return convert


alphabet = Alphabet()
config = EsmConfig(vocab_size=24, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                   max_position_embeddings=64, pad_token_id=alphabet.padding_idx, mask_token_id=None,
                   position_embedding_type="rotary", token_dropout=False, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0)
model = EsmModel(config, add_pooling_layer=False).eval()

data = [("protein1", "MKTVRQERLKSIVRILERSKEPV"), ("protein2", "KALTARQQEVFDLIRD"), ("protein3", "KALTARQ")]
_, _, tokens = alphabet.get_batch_converter()(data)
with torch.no_grad():
    if FIXED:
        out = model(tokens, attention_mask=tokens.ne(alphabet.padding_idx).long())
    else:
        out = model(tokens)
    reps = out.last_hidden_state
    worst = 0.0
    for i, (_, seq) in enumerate(data):  # each protein alone: no padding
        n = len(seq) + 2
        alone = model(tokens[i:i + 1, :n]).last_hidden_state[0]
        worst = max(worst, (reps[i, :n] - alone).abs().max().item())
print(f"max |batched - alone| per-residue representation: {worst:.6f}")
