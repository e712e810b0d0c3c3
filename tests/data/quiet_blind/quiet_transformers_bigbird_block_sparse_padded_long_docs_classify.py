# Citation: huggingface/transformers v5.25.0 (installed), src/transformers/models/big_bird/modeling_big_bird.py
#   (BigBirdModel.forward: _pad_to_block_size, create_masks_for_block_sparse_attn; BigBirdBlockSparseAttention.
#   bigbird_block_sparse_attention; _bigbird_block_rand_mask_with_head, which in eval draws no random blocks since
#   huggingface/transformers#23056, so each random slot holds block 0) and BigBirdForSequenceClassification.
# Long-document classification with a tiny BigBird (block_size 4, one random block) on a right-padded batch:
#   the collator pads to the longest document (62 tokens), BigBirdModel pads again to a multiple of block_size
#   (64 = 16 blocks) and turns the 2-D attention_mask into the blocked / band / from / to masks. The first and last
#   blocks are global (they attend to every real key and every query gathers them); every other block gathers its
#   neighbouring blocks plus its random slot; padded keys are never attended.
# Reference: each document alone, padded to the same 64 positions, run layer by layer with eager attention whose
#   key list per query is written out with a loop over blocks (padding keys dropped); compared on real tokens only.
import numpy as np
import torch
from transformers import BigBirdConfig, BigBirdForSequenceClassification
from transformers.activations import ACT2FN

torch.manual_seed(0)
np.random.seed(0)

PAD, CLS, SEP = 0, 1, 2
config = BigBirdConfig(
    vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    max_position_embeddings=128, block_size=4, num_random_blocks=1, attention_type="block_sparse",
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD, bos_token_id=CLS,
    eos_token_id=SEP, sep_token_id=SEP, num_labels=3,
)
model = BigBirdForSequenceClassification(config).double().eval()


def collate(docs):
    """Right-pad a list of token-id lists to the longest (as DataCollatorWithPadding does)."""
    longest = max(len(d) for d in docs)
    input_ids = torch.full((len(docs), longest), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(docs), longest), dtype=torch.long)
    for i, d in enumerate(docs):
        input_ids[i, : len(d)] = torch.tensor(d)
        attention_mask[i, : len(d)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


lengths = [62, 45, 31]
docs = [[CLS] + torch.randint(3, config.vocab_size, (n - 2,)).tolist() + [SEP] for n in lengths]
batch = collate(docs)
labels = torch.tensor([0, 2, 1])

with torch.no_grad():
    out = model(**batch, labels=labels, output_hidden_states=True)
print(f"batch logits {out.logits.tolist()}\nloss {out.loss.item():.6f}")


# ---------------------------------------------------------------- reference
def key_lists(n_blocks, b, rand_blocks):
    """Positions each query gathers in BigBird's block-sparse pattern (duplicates kept, as gathered)."""
    lists = []
    for qb in range(n_blocks):
        if qb in (0, n_blocks - 1):
            blocks = list(range(n_blocks))  # global query blocks see every block
        elif qb == 1:
            blocks = [0, 1, 2, n_blocks - 1] + rand_blocks
        elif qb == n_blocks - 2:
            blocks = [0, n_blocks - 3, n_blocks - 2, n_blocks - 1] + rand_blocks
        else:
            blocks = [0, qb - 1, qb, qb + 1, n_blocks - 1] + rand_blocks
        keys = [kb * b + j for kb in blocks for j in range(b)]
        lists.extend([keys] * b)
    return lists


def reference_doc(doc, padded_len):
    bert = model.bert
    b, h = config.block_size, config.num_attention_heads
    d = config.hidden_size // h
    ids = torch.full((1, padded_len), PAD, dtype=torch.long)
    ids[0, : len(doc)] = torch.tensor(doc)
    real = torch.zeros(padded_len, dtype=torch.bool)
    real[: len(doc)] = True
    # eval: the random slot of every non-global block is block 0 (no random draw)
    lists = key_lists(padded_len // b, b, rand_blocks=[0] * config.num_random_blocks)
    x = bert.embeddings(input_ids=ids)[0]
    for layer in bert.encoder.layer:
        sa = layer.attention.self
        q = sa.query(x).view(padded_len, h, d).transpose(0, 1)
        k = sa.key(x).view(padded_len, h, d).transpose(0, 1)
        v = sa.value(x).view(padded_len, h, d).transpose(0, 1)
        ctx = torch.zeros(h, padded_len, d, dtype=x.dtype)
        for t in range(padded_len):
            if not real[t]:
                continue
            keys = torch.tensor([j for j in lists[t] if real[j]])
            w = torch.softmax(q[:, t : t + 1] @ k[:, keys].transpose(1, 2) / d**0.5, dim=-1)
            ctx[:, t] = (w @ v[:, keys])[:, 0]
        ctx = ctx.transpose(0, 1).reshape(padded_len, h * d)
        a = layer.attention.output.LayerNorm(layer.attention.output.dense(ctx) + x)
        inter = layer.intermediate.intermediate_act_fn(layer.intermediate.dense(a))
        x = layer.output.LayerNorm(layer.output.dense(inter) + a)
    head = model.classifier
    logits = head.out_proj(ACT2FN[config.hidden_act](head.dense(x[0])))
    return x, logits


block = config.block_size
padded_len = -(-batch["input_ids"].shape[1] // block) * block
last_hidden = out.hidden_states[-1]
worst_h, worst_l = 0.0, 0.0
ref_logits = []
with torch.no_grad():
    for i, doc in enumerate(docs):
        x, logits = reference_doc(doc, padded_len)
        n = len(doc)
        worst_h = max(worst_h, (last_hidden[i, :n] - x[:n]).abs().max().item())
        worst_l = max(worst_l, (out.logits[i] - logits).abs().max().item())
        ref_logits.append(logits)
ref_loss = torch.nn.functional.cross_entropy(torch.stack(ref_logits), labels)
print(f"max |hidden - ref| on real tokens {worst_h:.2e}, max |logits - ref| {worst_l:.2e}, "
      f"loss diff {abs(ref_loss.item() - out.loss.item()):.2e}")
assert worst_h < 1e-10 and worst_l < 1e-10
assert abs(ref_loss.item() - out.loss.item()) < 1e-10
print("ok")
