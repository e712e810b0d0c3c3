# huggingface/sentence-transformers#2111 (commit 6b524f8c): lasttoken Pooling located the last real token with
# argmin(attention_mask) - 1, which for a row with no padding (all ones) gives -1, clamped to 0: the first token is pooled.
import sys
import torch
from transformers import GPT2Config, GPT2Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Pooling(torch.nn.Module):
    def __init__(self, word_embedding_dimension, pooling_mode="lasttoken"):
        super().__init__()
        self.word_embedding_dimension = word_embedding_dimension
        self.pooling_mode_lasttoken = pooling_mode == "lasttoken"

    def forward(self, features):
        token_embeddings = features["token_embeddings"]
        attention_mask = features["attention_mask"]
        output_vectors = []
        if self.pooling_mode_lasttoken:
            bs, seq_len, hidden_dim = token_embeddings.shape
            # attention_mask shape: (bs, seq_len)
            # Get shape [bs] indices of the last token (i.e. the last token for each batch item)
            if not FIXED:
                # argmin gives us the index of the first 0 in the attention mask; We get the last 1 index by subtracting 1
                gather_indices = torch.argmin(attention_mask, 1, keepdim=False) - 1  # Shape [bs]
            else:
                # Any sequence where min == 1, we use the entire sequence length since argmin = 0
                values, indices = torch.min(attention_mask, 1, keepdim=False)
                gather_indices = torch.where(values == 0, indices, seq_len) - 1  # Shape [bs]

            # There are empty sequences, where the index would become -1 which will crash
            gather_indices = torch.clamp(gather_indices, min=0)

            # Turn indices from shape [bs] --> [bs, 1, hidden_dim]
            gather_indices = gather_indices.unsqueeze(-1).repeat(1, hidden_dim)
            gather_indices = gather_indices.unsqueeze(1)
            assert gather_indices.shape == (bs, 1, hidden_dim)

            input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
            embedding = torch.gather(token_embeddings * input_mask_expanded, 1, gather_indices).squeeze(dim=1)
            output_vectors.append(embedding)

        features.update({"sentence_embedding": torch.cat(output_vectors, 1)})
        return features


config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=1,
                    eos_token_id=1, attn_implementation="eager")
auto_model = GPT2Model(config).eval()
pooling = Pooling(32, "lasttoken")

PAD = 0
seqs = [[3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18]]
L = max(len(s) for s in seqs)
input_ids = torch.tensor([s + [PAD] * (L - len(s)) for s in seqs])      # right padding (SGPT)
attention_mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])

with torch.no_grad():
    tok = auto_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    emb = pooling({"token_embeddings": tok, "attention_mask": attention_mask})["sentence_embedding"]
    # reference: each text alone, its final hidden state
    ref = torch.stack([auto_model(input_ids=torch.tensor([s])).last_hidden_state[0, -1] for s in seqs])
diff = (emb - ref).abs().max().item()
print(f"max |lasttoken embedding (batched) - last hidden state of each text alone|: {diff:.6f}")
