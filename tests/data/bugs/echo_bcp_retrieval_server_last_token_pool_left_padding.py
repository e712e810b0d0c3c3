# xiezijun714-lang/Echo PR #24: browsecomp_retrieval_server.py dense encoder (Qwen3-Embedding).
# The tokenizer pads on the left but _last_token_pool gathered index attention_mask.sum(1)-1 (right-padding
# convention), so batched documents are pooled at a pad or mid-sequence token.
import sys

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class DenseRetriever:
    def __init__(self, batch_size=4):
        # AutoModel.from_pretrained("Qwen/Qwen3-Embedding-8B") -> tiny random Qwen3Model
        config = Qwen3Config(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0)
        self.model = Qwen3Model(config).eval()
        self.batch_size = batch_size

    def tokenizer(self, batch, padding=True, return_tensors="pt"):
        # AutoTokenizer.from_pretrained(model_name, padding_side="left"): texts are already token ids here
        L = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), L, dtype=torch.long)
        mask = torch.zeros(len(batch), L, dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, L - len(s):] = torch.tensor(s)
            mask[i, L - len(s):] = 1
        return {"input_ids": ids, "attention_mask": mask}

    def _last_token_pool(self, last_hidden_states, attention_mask):
        # Qwen3-Embedding uses decoder architecture -> last token pooling.
        if FIXED:
            left_padding = (attention_mask[:, -1].sum() == attention_mask.shape[0])
            if left_padding:
                return last_hidden_states[:, -1]
        seq_lens = attention_mask.sum(dim=1) - 1
        batch_size = last_hidden_states.shape[0]
        return last_hidden_states[torch.arange(batch_size, device=last_hidden_states.device), seq_lens]

    def _encode(self, texts):
        all_embs = []
        for i in range(0, len(texts), self.batch_size):
            batch = texts[i: i + self.batch_size]
            enc = self.tokenizer(batch, padding=True, return_tensors="pt")
            with torch.no_grad():
                out = self.model(**enc)
            emb = self._last_token_pool(out.last_hidden_state, enc["attention_mask"])
            emb = F.normalize(emb, p=2, dim=1)
            all_embs.append(emb)
        return torch.cat(all_embs)


retriever = DenseRetriever(batch_size=4)
g = torch.Generator().manual_seed(1)
docs = [torch.randint(1, 100, (n,), generator=g).tolist() for n in (16, 7, 3, 11)]
batched = retriever._encode(docs)
retriever.batch_size = 1  # per-item encoding (the single-query search path): no padding
single = retriever._encode(docs)
cos = (batched * single).sum(-1)
print(f"batched vs per-item cosine: min {cos.min().item():.6f}; max abs diff {(batched - single).abs().max().item():.6f}")
