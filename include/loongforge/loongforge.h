/* LoongForge's C API: a trained robot policy in a C or C++ program without Python (libloongforge.so; CMake:
 * find_package(LoongForge) and link LoongForge::loongforge). Raw observations in (as the robot or simulator sends
 * them), the unnormalised action chunk out: what LeRobot's preprocessor -> predict_action_chunk -> postprocessor do,
 * for every policy family LoongForge trains (ACT, Diffusion Policy, pi0, pi0.5, GR00T, ...). A policy can be
 * fine-tuned on a LeRobot dataset in-process and saved as a LeRobot policy folder.
 *
 * A policy folder is LeRobot's layout (LoongForge's training checkpoints and LeRobot's save_pretrained write it):
 * config.json, model.safetensors, policy_preprocessor.json / policy_postprocessor.json with their state files, and
 * for policies that read the task as text their tokenizer / processor files.
 *
 * Conventions:
 * - Every function returning int returns LF_OK (0) on success. Functions taking (err, err_len) write a failure's
 *   message there as one line (truncated to err_len - 1 bytes, NUL-terminated; err may be NULL). Any function's last
 *   failure message on the calling thread is also lf_last_error()'s. Nothing throws: C++ exceptions never leave the
 *   library.
 * - lf_policy_predict / lf_policy_predict_prompt may be called from several threads on one policy at once (calls
 *   are serialised inside). lf_policy_finetune swaps the policy's weights when it is done; predictions running
 *   meanwhile use the old ones (both draw from LibTorch's global random generator, which predictions reseed: a
 *   fine-tune beside running predictions is not reproducible run to run). lf_policy_close must not race with other
 *   calls on the same policy.
 * - The library runs on the LibTorch it was built against (the torch wheel's lib folder is on its RUNPATH).
 */
#ifndef LOONGFORGE_LOONGFORGE_H
#define LOONGFORGE_LOONGFORGE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LF_OK 0
#define LF_ERROR 1          /* the message says why (err, lf_last_error()) */
#define LF_ERROR_CAPACITY 2 /* the actions buffer is too small; shape holds the chunk's shape */

typedef struct lf_policy lf_policy;

/* One observation feature, by the policy's LeRobot feature name, as float32 data (row-major, `ndim` dimensions):
 * - vectors ("observation.state", "observation.environment_state"): [D] (or [1, D]);
 * - cameras ("observation.images.<camera>"): [H, W, C] with values 0..255 (as a camera delivers pixels), or
 *   [C, H, W] with values in [0, 1] (LeRobot's dataset frames): a shape equal to the policy's [C, H, W] is read as
 *   the latter. A leading 1 is allowed.
 * Every input feature of the policy must be given once; others are errors naming the feature. */
typedef struct {
  const char *name;
  const float *data;
  const int64_t *shape;
  int ndim;
} lf_obs;

/* The library's version ("0.1.0"). */
const char *lf_version(void);

/* The calling thread's last failure message ("" when none). Valid until that thread's next call into the library. */
const char *lf_last_error(void);

/* Opens the policy folder DIR on the CPU. NULL on failure (err names the file and field). */
lf_policy *lf_policy_open(const char *dir, char *err, size_t err_len);

/* As lf_policy_open, on DEVICE: "cpu" or "cuda" (falls back to the CPU, saying so on stderr, without a GPU). */
lf_policy *lf_policy_open_on(const char *dir, const char *device, char *err, size_t err_len);

/* The action chunk's shape [chunk, action_dim] (what lf_policy_predict writes). */
int lf_policy_action_shape(lf_policy *policy, int64_t shape[2]);

/* The unnormalised action chunk for one observation (N_OBS features) into ACTIONS (row-major [chunk, action_dim],
 * CAPACITY floats), its shape into SHAPE. The same observation gives the same chunk (policies that sample draw
 * from a fixed seed). Policies that read the task text get an empty one: use lf_policy_predict_prompt.
 * Failure message: lf_last_error(). */
int lf_policy_predict(lf_policy *policy, const lf_obs *obs, size_t n_obs, float *actions, size_t capacity,
                      int64_t shape[2]);

/* As lf_policy_predict with the task text PROMPT (NULL: ""), for language-conditioned policies (pi0, pi0.5,
 * GR00T, ...); policies that read no text ignore it. */
int lf_policy_predict_prompt(lf_policy *policy, const lf_obs *obs, size_t n_obs, const char *prompt,
                             float *actions, size_t capacity, int64_t shape[2]);

/* Fine-tunes the policy on the LeRobot dataset folder DATASET_DIR (v3.0 / v2.1, or HDF5 episodes) and makes the
 * result the policy's weights and normalisation statistics (the dataset's, as LeRobot fine-tuning uses them).
 * RECIPE_YAML: a LoongForge recipe file (docs/recipes.md: train.steps, optim.*, schedule.*, data.robot.*, ...);
 * model.path, data.format / data.train and output_dir are set here (a temporary folder). NULL: the default
 * fine-tune recipe: 100 steps, micro-batch 8, AdamW lr 1e-5, weight decay 1e-4, gradient clip 10, constant rate, on
 * the policy's device. Blocks until done; predictions on other threads go on with the old weights meanwhile. */
int lf_policy_finetune(lf_policy *policy, const char *dataset_dir, const char *recipe_yaml, char *err, size_t err_len);

/* Writes the policy's current folder (weights, config.json, the processor files with its statistics, tokenizer
 * files) to DIR (created if needed; same-named files are replaced): a LeRobot policy folder that
 * PreTrainedPolicy.from_pretrained and make_pre_post_processors(pretrained_path=DIR) load, and lf_policy_open too. */
int lf_policy_save(lf_policy *policy, const char *dir, char *err, size_t err_len);

/* Frees the policy (NULL: nothing) and its temporary folders. */
void lf_policy_close(lf_policy *policy);

#ifdef __cplusplus
}
#endif

#endif /* LOONGFORGE_LOONGFORGE_H */
