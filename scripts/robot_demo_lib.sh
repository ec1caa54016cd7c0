# The robot demos' common end (sourced by scripts/act_demo.sh, diffusion_demo.sh, pi0_demo.sh, groot_demo.sh, run
# from the repository's root with LF, DATA, OUT and the SETS array of `--set` overrides defined):
# robot_demo_train_and_check RECIPE CHECKS [TRAIN_ARGS...] trains RECIPE, evaluates the last checkpoint open loop on
# the held-out episodes (plots under OUT/open_loop/final) and checks that it learned: the open-loop error is far below
# the mean action's (scripts/open_loop_check.py), and with CHECKS "prompt" also that the first action heads for the
# dot the prompt names (scripts/two_dot_check.py, on the two-dot dataset). Exits 1 unless it learned.
robot_demo_train_and_check() {
  local recipe=$1 checks=$2 ok=1
  shift 2
  $LF train "$recipe" "${SETS[@]}" "$@"
  CKPT=$OUT/checkpoints/$(cat "$OUT/checkpoints/latest")
  $LF eval "$recipe" "${SETS[@]}" --model "$CKPT" --open-loop "$OUT/open_loop/final" > "$OUT/open_loop.json"
  .venv/bin/python scripts/open_loop_check.py "$OUT/open_loop.json" "$DATA" || ok=0
  if [ "$checks" = prompt ]; then .venv/bin/python scripts/two_dot_check.py "$DATA" "$CKPT" "$LF" "$OUT" || ok=0; fi
  if [ $ok = 1 ]; then echo "learned: yes"; else echo "learned: NO"; exit 1; fi
  echo "checkpoint (a LeRobot policy folder): $CKPT"
}
