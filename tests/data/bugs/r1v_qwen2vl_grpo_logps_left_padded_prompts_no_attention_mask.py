"""R1-V (Deep-Agent/R1-V, now StarsfieldAI/R1-V) #32, merge 9b665df, commit 5715c29 ("fix bug for image input").

src/open-r1-multimodal/src/open_r1/trainer/grpo_trainer.py, Qwen2VLGRPOTrainer.compute_loss. The prompts
(chat text + one image each) go through the Qwen2-VL processor with padding_side="left", completions are
generated with the prompt's attention_mask, then the policy and reference per-token log-probs are recomputed by a
local `get_per_token_logps(model, input_ids)` that calls `model(input_ids)`: no attention_mask (the left pads of the
shorter prompt are attended, and the rope positions count from the pad slots), and no pixel_values /
image_grid_thw. The fix moves it to `self._get_per_token_logps(model, input_ids, attention_mask, pixel_values,
image_grid_thw)`, where attention_mask = cat([prompt_mask, completion_mask]) (completion mask cut after the first
EOS), and passes the repeated pixel_values / image_grid_thw.

The fix keeps the generation loop's torch.cat order (all prompts for generation 0, then generation 1) but repeats
prompt_mask with repeat_interleave; that is ported as written.
transformers 5 wants the processor's mm_token_type_ids beside image_grid_thw, so the fixed call passes them too.
Tiny Qwen2VLForConditionalGeneration from its config classes; the processor is replaced by hand-built left-padded
ids (one <|image_pad|> run per prompt) and random pixel patches.
"""
import copy
import sys

import torch
from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)

PAD_ID = 0
EOS_ID = 1
VISION_START_ID = 60
VISION_END_ID = 61
IMAGE_TOKEN_ID = 62
VIDEO_TOKEN_ID = 63
VOCAB = 64


def build_model():
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            bos_token_id=EOS_ID,
        ),
        vision_config=dict(
            depth=1,
            embed_dim=16,
            hidden_size=32,
            num_heads=2,
            mlp_ratio=2,
            in_channels=3,
            patch_size=2,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
    )
    config._attn_implementation = "sdpa"
    model = Qwen2VLForConditionalGeneration(config).eval()
    return model


def processor_call(prompt_token_lists, images):
    """Stands in for processing_class(text=..., images=..., padding=True, padding_side="left")."""
    rows = []
    for toks in prompt_token_lists:
        # one image of grid (t, h, w) = (1, 4, 4) -> 16 patches -> 4 merged tokens
        rows.append([VISION_START_ID] + [IMAGE_TOKEN_ID] * 4 + [VISION_END_ID] + toks)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r):] = torch.tensor(r)
        attention_mask[i, width - len(r):] = 1
    pixel_values = torch.cat(images, dim=0)
    image_grid_thw = torch.tensor([[1, 4, 4]] * len(rows))
    mm_token_type_ids = (input_ids == IMAGE_TOKEN_ID).long()  # what transformers 5's processor returns with the ids
    return {"input_ids": input_ids, "attention_mask": attention_mask, "pixel_values": pixel_values,
            "image_grid_thw": image_grid_thw, "mm_token_type_ids": mm_token_type_ids}


class Qwen2VLGRPOTrainer:
    def __init__(self, model, ref_model, num_generations=2, beta=0.04):
        self.model = model
        self.ref_model = ref_model
        self.num_generations = num_generations
        self.beta = beta
        self.max_prompt_length = None
        self.generation_config = GenerationConfig(
            max_new_tokens=6, do_sample=True, temperature=1.0, num_return_sequences=num_generations,
            pad_token_id=PAD_ID, eos_token_id=EOS_ID,
        )

    def _get_per_token_logps(self, model, input_ids, attention_mask, pixel_values, image_grid_thw, mm_token_type_ids):
        logits = model(input_ids, attention_mask=attention_mask, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                       mm_token_type_ids=mm_token_type_ids).logits  # (B, L, V)
        logits = logits[:, :-1, :]  # (B, L-1, V), exclude the last logit: it corresponds to the next token pred
        input_ids = input_ids[:, 1:]  # (B, L-1), exclude the first input ID since we don't have logits for it
        per_token_logps = []
        for logits_row, input_ids_row in zip(logits, input_ids):
            log_probs = logits_row.log_softmax(dim=-1)
            token_log_prob = torch.gather(log_probs, dim=1, index=input_ids_row.unsqueeze(1)).squeeze(1)
            per_token_logps.append(token_log_prob)
        return torch.stack(per_token_logps)

    def compute_loss(self, model, inputs, rewards):
        prompt_inputs = processor_call([x["prompt"] for x in inputs], [x["image"] for x in inputs])

        if FIXED:
            prompt_ids, prompt_mask = prompt_inputs["input_ids"], prompt_inputs["attention_mask"]
            if self.max_prompt_length is not None:
                prompt_ids = prompt_ids[:, -self.max_prompt_length:]
                prompt_mask = prompt_mask[:, -self.max_prompt_length:]
        elif self.max_prompt_length is not None:
            prompt_inputs["input_ids"] = prompt_inputs["input_ids"][:, -self.max_prompt_length:]
            prompt_inputs["attention_mask"] = prompt_inputs["attention_mask"][:, -self.max_prompt_length:]

        # Generate completions
        with torch.no_grad():
            num_generations = self.generation_config.num_return_sequences
            temp_generation_config = copy.deepcopy(self.generation_config)
            temp_generation_config.num_return_sequences = 1
            all_completions = []
            for i in range(num_generations):
                torch.manual_seed(100 + i)
                completion = model.generate(**prompt_inputs, generation_config=temp_generation_config)
                all_completions.append(completion)
            max_length = max(completion.size(1) for completion in all_completions)
            padded_completions = []
            for completion in all_completions:
                if completion.size(1) < max_length:
                    padding = torch.full((completion.size(0), max_length - completion.size(1)), PAD_ID,
                                         dtype=completion.dtype, device=completion.device)
                    padded_completion = torch.cat([completion, padding], dim=1)
                else:
                    padded_completion = completion
                padded_completions.append(padded_completion)
            prompt_completion_ids = torch.cat(padded_completions, dim=0)

            if FIXED:
                prompt_length = prompt_ids.size(1)
                prompt_ids = prompt_completion_ids[:, :prompt_length]
                completion_ids = prompt_completion_ids[:, prompt_length:]
                prompt_mask = prompt_mask.repeat_interleave(self.num_generations, dim=0)

        if not FIXED:
            prompt_length = prompt_inputs["input_ids"].size(1)
            completion_ids = prompt_completion_ids[:, prompt_length:]

            def get_per_token_logps(model, input_ids):
                logits = model(input_ids).logits  # (B, L, V)
                logits = logits[:, :-1, :]
                input_ids = input_ids[:, 1:]
                per_token_logps = []
                for logits_row, input_ids_row in zip(logits, input_ids):
                    log_probs = logits_row.log_softmax(dim=-1)
                    token_log_prob = torch.gather(log_probs, dim=1, index=input_ids_row.unsqueeze(1)).squeeze(1)
                    per_token_logps.append(token_log_prob)
                return torch.stack(per_token_logps)

            per_token_logps = get_per_token_logps(model, prompt_completion_ids)
            per_token_logps = per_token_logps[:, prompt_length - 1:]
            with torch.inference_mode():
                ref_per_token_logps = get_per_token_logps(self.ref_model, prompt_completion_ids)
            ref_per_token_logps = ref_per_token_logps[:, prompt_length - 1:]
            per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1

        # Mask everything after the first EOS token
        is_eos = completion_ids == EOS_ID
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        sequence_indices = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1)
        completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()

        if FIXED:
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (B*G, P+C)
            pixel_values = prompt_inputs["pixel_values"].repeat_interleave(self.num_generations, dim=0)
            image_grid_thw = prompt_inputs["image_grid_thw"].repeat_interleave(self.num_generations, dim=0)
            mm_token_type_ids = torch.cat([prompt_inputs["mm_token_type_ids"].repeat_interleave(self.num_generations, dim=0),
                                           torch.zeros_like(completion_ids)], dim=1)
            per_token_logps = self._get_per_token_logps(model, prompt_completion_ids, attention_mask, pixel_values, image_grid_thw, mm_token_type_ids)
            per_token_logps = per_token_logps[:, prompt_length - 1:]
            with torch.inference_mode():
                ref_per_token_logps = self._get_per_token_logps(self.ref_model, prompt_completion_ids, attention_mask, pixel_values, image_grid_thw, mm_token_type_ids)
            ref_per_token_logps = ref_per_token_logps[:, prompt_length - 1:]
            per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1

        # Group-normalised advantages (rewards are given: the reward functions are out of scope here)
        mean_grouped_rewards = rewards.view(-1, self.num_generations).mean(dim=1)
        std_grouped_rewards = rewards.view(-1, self.num_generations).std(dim=1)
        mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(self.num_generations, dim=0)
        std_grouped_rewards = std_grouped_rewards.repeat_interleave(self.num_generations, dim=0)
        advantages = (rewards - mean_grouped_rewards) / (std_grouped_rewards + 1e-4)

        per_token_loss = torch.exp(per_token_logps - per_token_logps.detach()) * advantages.unsqueeze(1)
        per_token_loss = -(per_token_loss - self.beta * per_token_kl)
        loss = ((per_token_loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)).mean()
        mean_kl = ((per_token_kl * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)).mean()
        return loss, mean_kl, per_token_logps, completion_mask


def main():
    model = build_model()
    ref_model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    trainer = Qwen2VLGRPOTrainer(model, ref_model, num_generations=2)

    patch_dim = 3 * 2 * 2 * 2
    inputs = [
        {"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13], "image": torch.randn(16, patch_dim)},
        {"prompt": [14, 15, 16], "image": torch.randn(16, patch_dim)},
    ]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    loss, mean_kl, per_token_logps, completion_mask = trainer.compute_loss(model, inputs, rewards)
    seq_logps = (per_token_logps * completion_mask).sum(dim=1)
    print("completion log-probs per sample:", [round(v, 4) for v in seq_logps.tolist()])
    print(f"mean KL: {mean_kl.item():.6f}")
    print(f"loss: {loss.item():.6f}")


if __name__ == "__main__":
    main()
