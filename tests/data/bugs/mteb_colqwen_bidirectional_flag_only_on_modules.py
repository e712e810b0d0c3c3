# embeddings-benchmark/mteb#5469 (fixes #5451): the ColQwen3_5 wrapper's bidirectional fallback set only the
# attention modules' is_causal=False; create_causal_mask reads config.is_causal, so sdpa on a padded batch stayed causal.
import sys

import torch
from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def enable_bidirectional_attention(model):
    """Local fallback used when the PyPI colpali_engine lacks ColQwen3_5.enable_bidirectional_attention."""
    if FIXED:
        # create_causal_mask() only looks at the config flag (what sdpa honours on padded batches)
        model.config.is_causal = False
    for module in model.modules():
        if hasattr(module, "is_causal") and module.__class__.__name__.endswith("Attention"):
            module.is_causal = False
    return model


class ColQwen3_5(torch.nn.Module):
    """Late-interaction retriever: multi-vector embeddings from the last hidden state."""

    def __init__(self, config, dim=16):
        super().__init__()
        self.model = Qwen3_5TextModel(config)
        self.custom_text_proj = torch.nn.Linear(config.hidden_size, dim)

    def forward(self, input_ids, attention_mask):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        proj = self.custom_text_proj(hidden)
        proj = proj / proj.norm(dim=-1, keepdim=True)
        return proj * attention_mask.unsqueeze(-1)


def score_multi_vector(qs, ds):
    return torch.einsum("bnd,csd->bcns", qs, ds).max(dim=3)[0].sum(dim=2)


config = Qwen3_5TextConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    layer_types=["full_attention", "full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
)
config._attn_implementation = "sdpa"
model = ColQwen3_5(config).eval()
enable_bidirectional_attention(model.model)

# padded batch of documents (right padding), as the retrieval evaluation encodes them
docs = torch.randint(1, 128, (2, 10))
doc_mask = torch.ones(2, 10, dtype=torch.long)
doc_mask[1, 6:] = 0
queries = torch.randint(1, 128, (2, 5))
query_mask = torch.ones(2, 5, dtype=torch.long)

with torch.no_grad():
    d = model(docs, doc_mask)
    q = model(queries, query_mask)
    scores = score_multi_vector(q, d)

    # reference: the released bidirectional implementation (both switches set), same weights
    model.model.config.is_causal = False
    d_ref = model(docs, doc_mask)

print("fixed" if FIXED else "buggy", "scores", [round(v, 4) for v in scores.flatten().tolist()])
print("max |doc embeddings - bidirectional reference| =", (d - d_ref).abs().max().item())
