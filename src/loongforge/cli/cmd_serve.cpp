// loongforge serve: a trained robot policy behind openpi's websocket + msgpack protocol (serve/policy_server.h), so
// openpi-client's WebsocketClientPolicy (and any client of openpi's policy servers) drives it unchanged.
#include <cstdio>
#include <memory>

#include "loongforge/cli/commands.h"
#include "loongforge/core/error.h"
#include "loongforge/serve/policy_server.h"
#include "loongforge/serve/websocket.h"
#include "loongforge/train/policy_runner.h"

namespace lf::cli {

namespace {
struct ServeArgs {
  std::string policy, device = "cpu";
  double max_message_mb = 64;
  serve::ServeOptions opts;
};
}  // namespace

void add_serve(CLI::App& app) {
  auto args = std::make_shared<ServeArgs>();
  auto* sub = app.add_subcommand("serve", "Serve a robot policy over openpi's websocket protocol (openpi-client)");
  sub->add_option("--policy", args->policy, "policy folder (LeRobot's layout: config.json, model.safetensors, "
                  "policy_preprocessor.json / policy_postprocessor.json)")->required();
  sub->add_option("--host", args->opts.host, "address to listen on (0.0.0.0: every interface)")->capture_default_str();
  sub->add_option("--port", args->opts.port, "port to listen on (0: any free port)")->capture_default_str()
      ->check(CLI::Range(0, 65535));
  sub->add_option("--device", args->device, "cpu or cuda (without a usable GPU: one line, then the CPU)")
      ->capture_default_str()->check(CLI::IsMember({"cpu", "cuda"}));
  sub->add_option("--max-message-mb", args->max_message_mb, "largest request accepted (MiB); a bigger one closes "
                  "its connection")->capture_default_str()->check(CLI::Range(0.001, 4096.0));
  sub->add_option("--workers", args->opts.workers, "request threads (connections are served at once; predict "
                  "itself runs one at a time)")->capture_default_str()->check(CLI::Range(1, 256));
  sub->add_option("--seed", args->opts.seed, "a connection's request i samples from seed + i (sampling "
                  "policies)")->capture_default_str();
  sub->add_option("--report-every", args->opts.report_every, "a latency line (p50 / p99) to stderr every N "
                  "requests (0: only the summary at exit)")->capture_default_str()->check(CLI::NonNegativeNumber);
  sub->callback([args] {
    if (!serve::available()) throw Error(serve::missing_message());
    args->opts.max_message_bytes = static_cast<size_t>(args->max_message_mb * 1024 * 1024);
    train::PolicyRunner runner(args->policy, args->device);
    serve::PolicyServer server(runner, args->opts);
    const std::string type = runner.metadata().value("policy_type", std::string("policy"));
    std::printf("loongforge serve: %s (%s) listening on ws://%s\n", args->policy.c_str(), type.c_str(),
                server.address().c_str());
    std::fflush(stdout);
    server.run();
  });
}

}  // namespace lf::cli
