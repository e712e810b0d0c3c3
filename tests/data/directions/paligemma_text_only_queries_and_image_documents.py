"""PaliGemma (transformers 5, built from its config classes) run as a retriever: text-only queries, image documents.

transformers' PaliGemmaConfig sets its text config's `use_bidirectional_attention=True` (its attention modules then
say `is_causal=False`), and PaliGemmaModel builds its mask with `create_causal_mask`, bidirectional only over a prefix
that `token_type_ids` mark. Queries handed without `token_type_ids` in a right-padded batch get a 4-D causal mask; the
same query alone, unpadded, gets no mask at all, and SDPA runs it with the module's is_causal=False: both ways. So one
query's states depend on whether it was padded into a batch (ColPali's queries, written blind, batch blind-ls). The
program prints how far apart they are.
"""
import torch
from transformers import GemmaConfig, PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

torch.manual_seed(0)
vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                            image_size=28, patch_size=14, projection_dim=32)
text = GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=16, pad_token_id=0)
config = PaliGemmaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(), image_token_index=63,
                         projection_dim=32, hidden_size=32)
model = PaliGemmaForConditionalGeneration(config).eval()

queries = [[2, 10, 11, 12, 13, 1], [2, 14, 15, 1]]
ids = torch.zeros(2, 6, dtype=torch.long)
mask = torch.zeros(2, 6, dtype=torch.long)
for i, q in enumerate(queries):
    ids[i, :len(q)], mask[i, :len(q)] = torch.tensor(q), 1
docs = torch.tensor([[63] * 4 + [2, 20, 21, 1], [63] * 4 + [2, 22, 23, 1]])
with torch.no_grad():
    batch = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    for i, q in enumerate(queries):
        alone = model(input_ids=torch.tensor([q]), output_hidden_states=True).hidden_states[-1]
        print(f"query {i}: padded in the batch vs alone differ by {float((batch[i, :len(q)] - alone[0]).abs().max()):.3f}")
    model(input_ids=docs, attention_mask=torch.ones_like(docs), pixel_values=torch.randn(2, 3, 28, 28))
