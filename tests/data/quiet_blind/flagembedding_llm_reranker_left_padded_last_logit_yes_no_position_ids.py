# FlagEmbedding LLM reranker (FlagEmbedding/inference/reranker/decoder_only/base.py, BaseLLMReranker.compute_score):
# tokenizer padding_side="left", model(input_ids, attention_mask) with no position_ids, score = logits[:, -1, yes_loc].
# Left padding only shifts every real token's RoPE position by the same offset, so scores equal each pair alone.
import warnings; warnings.filterwarnings('ignore')
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
PAD, YES = 0, 7
cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, pad_token_id=PAD)
cfg._attn_implementation = "sdpa"
model = LlamaForCausalLM(cfg).double().eval()
sep = [30, 31]
prompt = [40, 41, 42]  # "Predict whether passage B contains an answer to query A ... 'Yes' or 'No'."
pairs = [([1, 5, 6], [11, 12, 13, 14, 15, 16]), ([1, 8], [17, 18]), ([1, 9, 10, 20], [21, 22, 23])]

with torch.no_grad():
    seqs = [q + sep + p + sep + prompt for q, p in pairs]
    L = max(map(len, seqs))
    ids = torch.full((len(seqs), L), PAD); am = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s); am[i, L - len(s):] = 1
    scores = model(input_ids=ids, attention_mask=am, return_dict=True).logits[:, -1, YES]
    ref = torch.stack([model(input_ids=torch.tensor([s])).logits[0, -1, YES] for s in seqs])
    diff = (scores - ref).abs().max().item()
    print("max diff left-padded reranker score (no position_ids) vs each pair alone:", diff)
    assert diff < 1e-9
