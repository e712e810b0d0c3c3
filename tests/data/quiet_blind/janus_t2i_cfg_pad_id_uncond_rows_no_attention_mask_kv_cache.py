"""Janus text-to-image decoding with classifier-free guidance rows.

Follows deepseek-ai/Janus, generation_inference.py, generate(): the prompt is repeated
into 2*parallel_size rows; every odd row is the UNCONDITIONAL row, made by overwriting
the prompt with pad_id except its first token (BOS) and last token (the image-start
tag):  tokens[i, 1:-1] = vl_chat_processor.pad_id.  The language model
(a LlamaForCausalLM in janus/models/modeling_vlm.py, MultiModalityCausalLM) is called
with inputs_embeds and use_cache=True and NO attention_mask: the pad tokens of the
unconditional rows are not padding but the "empty prompt" content Janus was trained on
(its text condition is dropped to pads), so every row attends to all of its tokens.
Rows all have the same length, so there is no padding in the batch at all. Logits are
mixed as uncond + cfg_weight * (cond - uncond); the sampled image token is fed to BOTH
rows of a pair through prepare_gen_img_embeds (gen_embed + gen_aligner).
Check: at every step, the cached batched logits of each row equal a full no-cache
forward of that row alone over its whole history.
"""
import torch
from transformers import LlamaConfig, LlamaModel

torch.manual_seed(0)
DT = torch.float64
VOCAB, IMG_VOCAB, PAD_ID, N_IMG_TOK, PARALLEL, CFG = 40, 24, 3, 6, 2, 5.0


def main():
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    lm = LlamaModel(cfg).to(DT).eval()
    gen_head = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, IMG_VOCAB)).to(DT)
    gen_embed = torch.nn.Embedding(IMG_VOCAB, 8).to(DT)
    gen_aligner = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32)).to(DT)

    def prepare_gen_img_embeds(ids):
        return gen_aligner(gen_embed(ids))

    input_ids = torch.tensor([1, 11, 17, 9, 22, 30, 14, 2])  # BOS ... <begin_of_image>
    tokens = torch.zeros(PARALLEL * 2, len(input_ids), dtype=torch.long)
    for i in range(PARALLEL * 2):
        tokens[i, :] = input_ids
        if i % 2 != 0:
            tokens[i, 1:-1] = PAD_ID
    inputs_embeds = lm.get_input_embeddings()(tokens)
    history = inputs_embeds.clone()  # every row's full input, for the no-cache reference

    g = torch.Generator().manual_seed(1)
    generated = torch.zeros(PARALLEL, N_IMG_TOK, dtype=torch.long)
    worst = 0.0
    past = None
    with torch.no_grad():
        for i in range(N_IMG_TOK):
            outputs = lm(inputs_embeds=inputs_embeds, use_cache=True, past_key_values=past)
            past = outputs.past_key_values
            logits = gen_head(outputs.last_hidden_state[:, -1, :])

            for r in range(PARALLEL * 2):  # reference: one row, no cache, whole history
                ref_h = lm(inputs_embeds=history[r:r + 1], use_cache=False).last_hidden_state
                worst = max(worst, (gen_head(ref_h[:, -1]) - logits[r:r + 1]).abs().max().item())

            logit_cond, logit_uncond = logits[0::2, :], logits[1::2, :]
            mixed = logit_uncond + CFG * (logit_cond - logit_uncond)
            probs = torch.softmax(mixed, dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=g)
            generated[:, i] = next_token.squeeze(-1)
            next_token = torch.cat([next_token.unsqueeze(1), next_token.unsqueeze(1)], dim=1).view(-1)
            inputs_embeds = prepare_gen_img_embeds(next_token).unsqueeze(1)
            history = torch.cat([history, inputs_embeds], 1)

    print("uncond rows:", tokens[1].tolist())
    print("generated image tokens:", generated.tolist())
    print(f"max|cached batched logits - per-row no-cache logits| = {worst:.2e}")
    assert worst < 1e-10, worst
    print("ok")


if __name__ == "__main__":
    main()
