# huggingface/sentence-transformers#3598 (commit 3c02ed6d): Pooling(include_prompt=False) zeroed attention_mask[:, :prompt_length],
# which with a left-padding tokenizer hits the pad slots instead of the prompt, so prompt tokens leak into the mean pooling.
import sys
import torch
from transformers import Qwen2Config, Qwen2Model

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


class Pooling(torch.nn.Module):
    def __init__(self, word_embedding_dimension, pooling_mode_mean_tokens=True, include_prompt=True):
        super().__init__()
        self.word_embedding_dimension = word_embedding_dimension
        self.pooling_mode_mean_tokens = pooling_mode_mean_tokens
        self.include_prompt = include_prompt

    def forward(self, features):
        token_embeddings = features["token_embeddings"]
        attention_mask = (
            features["attention_mask"]
            if "attention_mask" in features
            else torch.ones(token_embeddings.shape[:-1], device=token_embeddings.device, dtype=torch.int64)
        )
        if not self.include_prompt and "prompt_length" in features:
            prompt_length = features["prompt_length"]
            if isinstance(prompt_length, torch.Tensor):
                prompt_length = prompt_length[0].item()

            if not FIXED:
                attention_mask[:, :prompt_length] = 0
            else:
                # Check where the first non-pad token is located
                pad_lengths = attention_mask.to(torch.int32).argmax(dim=1)
                if pad_lengths.sum() == 0:
                    attention_mask[:, :prompt_length] = 0
                else:
                    prompt_and_pad_lengths = pad_lengths + prompt_length  # shape: (bs)
                    seq_len = attention_mask.size(1)
                    positions = torch.arange(seq_len, device=attention_mask.device).unsqueeze(0)
                    mask = positions < prompt_and_pad_lengths.unsqueeze(1)
                    attention_mask[mask] = 0

        output_vectors = []
        if self.pooling_mode_mean_tokens:
            input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).to(token_embeddings.dtype)
            sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)
            sum_mask = torch.clamp(input_mask_expanded.sum(1), min=1e-9)
            output_vectors.append(sum_embeddings / sum_mask)
        features["sentence_embedding"] = torch.cat(output_vectors, 1)
        return features


class Transformer(torch.nn.Module):
    def __init__(self, auto_model):
        super().__init__()
        self.auto_model = auto_model

    def forward(self, features):
        trans_features = {k: v for k, v in features.items() if k in ("input_ids", "attention_mask")}
        out = self.auto_model(**trans_features, return_dict=True)
        features["token_embeddings"] = out.last_hidden_state
        return features


config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     attn_implementation="sdpa")
model = Transformer(Qwen2Model(config).eval())
pooling = Pooling(32, pooling_mode_mean_tokens=True, include_prompt=False)

PAD = 0
prompt = [5, 6, 7, 8]                    # e.g. "query: " instruction tokens
texts = [[10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]
seqs = [prompt + t for t in texts]
L = max(len(s) for s in seqs)
# left-padding tokenizer (padding_side="left")
input_ids = torch.tensor([[PAD] * (L - len(s)) + s for s in seqs])
attention_mask = torch.tensor([[0] * (L - len(s)) + [1] * len(s) for s in seqs])


def encode(input_ids, attention_mask):
    features = {"input_ids": input_ids, "attention_mask": attention_mask.clone(), "prompt_length": len(prompt)}
    with torch.no_grad():
        return pooling(model(features))["sentence_embedding"]


emb_batched = encode(input_ids, attention_mask)
emb_alone = encode(torch.tensor([seqs[1]]), torch.ones(1, len(seqs[1]), dtype=torch.long))
diff = (emb_batched[1] - emb_alone[0]).abs().max().item()
print(f"max |mean-pool(batched, left-padded) - mean-pool(alone)| for the short text: {diff:.3e}")
