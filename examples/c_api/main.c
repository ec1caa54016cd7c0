/* A robot program using a LoongForge policy through the C API: opens a policy folder, optionally fine-tunes it on
 * a LeRobot dataset and saves it, then predicts the action chunk for one observation and prints it.
 *
 *   lf_example POLICY_DIR OBS_FILE [--prompt TEXT] [--finetune DATASET_DIR] [--recipe YAML] [--save DIR]
 *              [--threads N]
 *
 * OBS_FILE (text): per observation feature its name, ndim, the dimensions and the float values, whitespace
 * separated ('#' starts a comment line), e.g.
 *   observation.state 1 4   0.1 0.2 0.3 0.4
 *   observation.images.top 3 24 32 3   ...24*32*3 values 0..255 ([H, W, C])...
 * Output: "actions CHUNK DIM" (also lf_policy_action_shape's), then CHUNK lines of DIM values. --threads N: N threads predict the same observation
 * at once (4 times each) and every chunk must equal the first one.
 * Errors: one line on stderr, exit status 1. */
#include <loongforge/loongforge.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_OBS 16
#define MAX_DIMS 8

typedef struct {
  char name[256];
  int64_t shape[MAX_DIMS];
  int ndim;
  float *data;
} observation;

static observation observations[MAX_OBS];
static lf_obs obs[MAX_OBS];
static size_t n_obs = 0;

static int read_observations(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "error: %s: cannot open\n", path);
    return 1;
  }
  char word[256];
  while (fscanf(f, "%255s", word) == 1) {
    if (word[0] == '#') {
      int c;
      while ((c = fgetc(f)) != EOF && c != '\n') {}
      continue;
    }
    if (n_obs == MAX_OBS) {
      fprintf(stderr, "error: %s: more than %d observations\n", path, MAX_OBS);
      fclose(f);
      return 1;
    }
    observation *o = &observations[n_obs];
    snprintf(o->name, sizeof o->name, "%s", word);
    if (fscanf(f, "%d", &o->ndim) != 1 || o->ndim < 0 || o->ndim > MAX_DIMS) {
      fprintf(stderr, "error: %s: %s: bad ndim\n", path, o->name);
      fclose(f);
      return 1;
    }
    size_t numel = 1;
    for (int d = 0; d < o->ndim; ++d) {
      long long v;
      if (fscanf(f, "%lld", &v) != 1 || v < 0) {
        fprintf(stderr, "error: %s: %s: bad dimension %d\n", path, o->name, d);
        fclose(f);
        return 1;
      }
      o->shape[d] = v;
      numel *= (size_t)v;
    }
    o->data = malloc(sizeof(float) * (numel ? numel : 1));
    for (size_t i = 0; i < numel; ++i)
      if (fscanf(f, "%f", &o->data[i]) != 1) {
        fprintf(stderr, "error: %s: %s: %zu values expected\n", path, o->name, numel);
        fclose(f);
        return 1;
      }
    obs[n_obs].name = o->name;
    obs[n_obs].data = o->data;
    obs[n_obs].shape = o->shape;
    obs[n_obs].ndim = o->ndim;
    ++n_obs;
  }
  fclose(f);
  return 0;
}

typedef struct {
  lf_policy *policy;
  const char *prompt;
  const float *expected;
  int64_t shape[2];
  int failures;
} worker;

static void *predict_repeatedly(void *arg) {
  worker *w = arg;
  size_t n = (size_t)(w->shape[0] * w->shape[1]);
  float *a = malloc(sizeof(float) * (n ? n : 1));
  for (int i = 0; i < 4; ++i) {
    int64_t shape[2];
    if (lf_policy_predict_prompt(w->policy, obs, n_obs, w->prompt, a, n, shape) != LF_OK) {
      fprintf(stderr, "error: thread predict: %s\n", lf_last_error());
      ++w->failures;
    } else if (shape[0] != w->shape[0] || shape[1] != w->shape[1] || memcmp(a, w->expected, sizeof(float) * n) != 0) {
      fprintf(stderr, "error: a thread's chunk differs from the first one\n");
      ++w->failures;
    }
  }
  free(a);
  return NULL;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s POLICY_DIR OBS_FILE [--prompt TEXT] [--finetune DATASET_DIR] [--recipe YAML] "
                    "[--save DIR] [--threads N]\n", argv[0]);
    return 2;
  }
  const char *prompt = NULL, *dataset = NULL, *recipe = NULL, *save = NULL;
  int threads = 0;
  for (int i = 3; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--prompt")) prompt = argv[i + 1];
    else if (!strcmp(argv[i], "--finetune")) dataset = argv[i + 1];
    else if (!strcmp(argv[i], "--recipe")) recipe = argv[i + 1];
    else if (!strcmp(argv[i], "--save")) save = argv[i + 1];
    else if (!strcmp(argv[i], "--threads")) threads = atoi(argv[i + 1]);
    else {
      fprintf(stderr, "error: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (read_observations(argv[2])) return 1;

  char err[1024];
  lf_policy *policy = lf_policy_open(argv[1], err, sizeof err);
  if (!policy) {
    fprintf(stderr, "error: %s\n", err);
    return 1;
  }
  if (dataset && lf_policy_finetune(policy, dataset, recipe, err, sizeof err) != LF_OK) {
    fprintf(stderr, "error: %s\n", err);
    lf_policy_close(policy);
    return 1;
  }
  if (save && lf_policy_save(policy, save, err, sizeof err) != LF_OK) {
    fprintf(stderr, "error: %s\n", err);
    lf_policy_close(policy);
    return 1;
  }

  /* Ask for the shape first (a too-small buffer says the shape), then predict into a buffer of that size. */
  int64_t shape[2];
  float probe;
  int rc = lf_policy_predict_prompt(policy, obs, n_obs, prompt, &probe, 0, shape);
  if (rc != LF_ERROR_CAPACITY && rc != LF_OK) {
    fprintf(stderr, "error: %s\n", lf_last_error());
    lf_policy_close(policy);
    return 1;
  }
  size_t n = (size_t)(shape[0] * shape[1]);
  float *actions = malloc(sizeof(float) * (n ? n : 1));
  if (lf_policy_predict_prompt(policy, obs, n_obs, prompt, actions, n, shape) != LF_OK) {
    fprintf(stderr, "error: %s\n", lf_last_error());
    lf_policy_close(policy);
    return 1;
  }
  int64_t declared[2];
  if (lf_policy_action_shape(policy, declared) != LF_OK || declared[0] != shape[0] || declared[1] != shape[1]) {
    fprintf(stderr, "error: lf_policy_action_shape disagrees with the chunk predicted\n");
    lf_policy_close(policy);
    return 1;
  }
  printf("actions %lld %lld\n", (long long)shape[0], (long long)shape[1]);
  for (int64_t r = 0; r < shape[0]; ++r)
    for (int64_t c = 0; c < shape[1]; ++c) printf("%.9g%c", actions[r * shape[1] + c], c + 1 == shape[1] ? '\n' : ' ');

  int failures = 0;
  if (threads > 0) {
    pthread_t *ids = malloc(sizeof(pthread_t) * (size_t)threads);
    worker *ws = calloc((size_t)threads, sizeof(worker));
    for (int t = 0; t < threads; ++t) {
      ws[t] = (worker){policy, prompt, actions, {shape[0], shape[1]}, 0};
      pthread_create(&ids[t], NULL, predict_repeatedly, &ws[t]);
    }
    for (int t = 0; t < threads; ++t) {
      pthread_join(ids[t], NULL);
      failures += ws[t].failures;
    }
    if (!failures) printf("threads %d x 4 predictions equal the first\n", threads);
    free(ids);
    free(ws);
  }
  free(actions);
  lf_policy_close(policy);
  for (size_t i = 0; i < n_obs; ++i) free(observations[i].data);
  return failures ? 1 : 0;
}
