# Citation: huggingface/transformers src/transformers/data/data_collator.py DataCollatorWithFlattening and
#   src/transformers/masking_utils.py (find_packed_sequence_indices, packed_sequence_mask_function, create_causal_mask),
#   as used for padding-free SFT (the "Packing with position_ids" blog / TRL padding_free).
# Examples are concatenated into one row with no padding and no attention_mask; position_ids restart at 0 for each
# example. With no cache (training, or use_cache=False) create_causal_mask detects the restarts and builds a block-diagonal causal mask for SDPA, so no token sees
# the previous example; labels carry -100 at each example's first token so no cross-example next-token is learned.
# Written blind as a correct program (batch quiet-zn); maskcli found its training step wrong, and it is: the training
# call passes no use_cache, the config's use_cache=True makes a DynamicCache inside the forward, and masking_utils
# reads packed documents only where `cache is None`, so that step ran a plain causal mask across the examples (its
# logits differ from use_cache=False by 0.5). --fixed: the training call passes use_cache=False.
import sys

import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)

config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
config._attn_implementation = "sdpa"
model = LlamaForCausalLM(config)
collator = DataCollatorWithFlattening(return_position_ids=True)
features = [{"input_ids": torch.randint(3, 128, (n,)).tolist()} for n in (7, 12, 5)]
batch = collator(features)
print("position_ids", batch["position_ids"].tolist())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model.train()
out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
            **({"use_cache": False} if "--fixed" in sys.argv else {}))
out.loss.backward()
opt.step()

# check: same logits as running each example alone
model.eval()
with torch.no_grad():
    packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    start = 0
    for f in features:
        n = len(f["input_ids"])
        alone = model(input_ids=torch.tensor([f["input_ids"]]), use_cache=False).logits[0]
        assert torch.allclose(packed[start:start + n], alone, atol=1e-4)
        start += n
print("packed loss %.4f" % out.loss.item())
