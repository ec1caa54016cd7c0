// A policy server speaking openpi's websocket + msgpack protocol (protocol.h), so openpi-client's
// WebsocketClientPolicy drives a LoongForge policy (train::PolicyRunner) unchanged: `loongforge serve`.
//
// On connect the server sends the policy's metadata (PolicyRunner::metadata()); each request is a map of raw
// observations by LeRobot feature name plus "prompt"; the reply is {"actions": float32 [chunk, action_dim]
// (unnormalised), "policy_timing": {"infer_ms"}, "server_timing": {"infer_ms", "prev_total_ms"}} as openpi's server
// answers. A request that cannot be served (malformed message, missing feature, ...) is answered with one line of text
// and its connection is closed (1011), as openpi's server does; the server goes on serving the others. Connections
// are served at once (a pool of workers; predict itself is serialised by the runner); each connection's requests in
// order. A message over max_message_bytes closes its connection (1009 "message too big").
//
// Latency: per request from its arrival to its reply being handed to the network, a line to stderr every
// report_every requests and a summary at exit (p50 / p99).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lf::train {
class PolicyRunner;
}

namespace lf::serve {

struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                       // 0: any free port (the "listening on" line says which)
  size_t max_message_bytes = 64u << 20;
  int workers = 2;                       // request threads (decode, predict, encode)
  int max_pending = 4;                   // requests a connection may have waiting; more is an error
  uint64_t seed = 0;                     // a connection's request i draws its samples from seed + i
  int report_every = 100;                // a latency line every this many requests (0: only at exit)
};

// The latency percentile P (0..100) of SAMPLES (nearest rank; 0 when empty).
double percentile(std::vector<double> samples, double p);

class PolicyServer {
 public:
  // Binds (a port in use is one line) and prepares the metadata message.
  PolicyServer(train::PolicyRunner& runner, const ServeOptions& options);
  ~PolicyServer();

  std::string address() const;  // host:port bound
  // Serves until stop() or SIGINT / SIGTERM; prints the latency summary to stderr at the end.
  void run();
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lf::serve
