// The policy server (policy_server.h): the WebSocket transport, openpi's messages and a PolicyRunner, joined by a
// small pool of request threads.
#include "loongforge/serve/policy_server.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "loongforge/core/error.h"
#include "loongforge/serve/protocol.h"
#include "loongforge/serve/websocket.h"
#include "loongforge/train/policy_runner.h"

namespace lf::serve {

double percentile(std::vector<double> samples, double p) {
  if (samples.empty()) return 0.0;
  std::sort(samples.begin(), samples.end());
  const double rank = std::ceil(p / 100.0 * static_cast<double>(samples.size()));
  const size_t k = static_cast<size_t>(std::clamp(rank, 1.0, static_cast<double>(samples.size()))) - 1;
  return samples[k];
}

namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) { return std::chrono::duration<double, std::milli>(Clock::now() - t).count(); }

// The first line of an exception's text (ATen's errors carry a backtrace below it).
std::string first_line(const char* what) {
  std::string s(what);
  auto k = s.find('\n');
  return k == std::string::npos ? s : s.substr(0, k);
}

// LINE as valid UTF-8 (a text frame must be; an error may quote a feature name made of any bytes): every byte that
// does not start a well-formed sequence becomes '?'.
std::string valid_utf8(const std::string& line) {
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(line.data());
  const size_t n = line.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    bool ok = len > 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) ok = (p[i + k] >> 6) == 0x2;
    if (ok && len > 1) {  // no overlong forms, surrogates or code points past U+10FFFF
      uint32_t cp = c & (0x7f >> len);
      for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (p[i + k] & 0x3f);
      ok = cp >= (len == 2 ? 0x80u : len == 3 ? 0x800u : 0x10000u) && cp <= 0x10ffff && (cp < 0xd800 || cp > 0xdfff);
    }
    if (ok) {
      out.append(line, i, len);
      i += len;
    } else {
      out += '?';
      ++i;
    }
  }
  return out;
}

struct Message {
  std::string payload;
  Clock::time_point arrived;
};

struct Connection {
  uint64_t id = 0;
  std::string peer;
  std::deque<Message> pending;
  bool scheduled = false;  // in the ready queue or being served
  bool closed = false;
  uint64_t served = 0;
  double prev_total_ms = -1;
};

}  // namespace

struct PolicyServer::Impl {
  train::PolicyRunner& runner;
  ServeOptions options;
  std::string metadata;  // the msgpack message sent on connect
  std::unique_ptr<WebsocketServer> ws;

  std::mutex mu;  // guards everything below
  std::condition_variable cv;
  std::map<uint64_t, std::shared_ptr<Connection>> conns;
  std::deque<std::shared_ptr<Connection>> ready;
  bool stopping = false;
  static constexpr size_t kKeep = 1 << 20;
  std::vector<double> latency_ms, infer_ms;  // the served requests' (the latest kKeep at least)
  size_t reported = 0;                       // samples covered by the last latency line
  uint64_t requests = 0;
  uint64_t connections = 0, errors = 0;

  Impl(train::PolicyRunner& r, const ServeOptions& o) : runner(r), options(o) {}

  void on_open(uint64_t id, const std::string& peer) {
    auto c = std::make_shared<Connection>();
    c->id = id;
    c->peer = peer;
    {
      std::lock_guard<std::mutex> lk(mu);
      conns[id] = c;
      ++connections;
    }
    std::fprintf(stderr, "loongforge serve: connection %llu from %s opened\n", static_cast<unsigned long long>(id),
                 peer.c_str());
    ws->send(id, metadata, true);
  }

  void on_message(uint64_t id, std::string&& payload) {
    std::shared_ptr<Connection> c;
    bool overflow = false;
    {
      std::lock_guard<std::mutex> lk(mu);
      auto it = conns.find(id);
      if (it == conns.end() || it->second->closed) return;
      c = it->second;
      if (c->pending.size() >= static_cast<size_t>(options.max_pending)) {
        overflow = true;
        c->closed = true;
        c->pending.clear();
        ++errors;
      } else {
        c->pending.push_back({std::move(payload), Clock::now()});
        if (!c->scheduled) {
          c->scheduled = true;
          ready.push_back(c);
          cv.notify_one();
        }
      }
    }
    if (overflow) {
      fail(*c, "request: more than " + std::to_string(options.max_pending) +
                   " requests waiting on one connection (send the next after the reply)");
    }
  }

  void on_close(uint64_t id, const std::string& why) {
    {
      std::lock_guard<std::mutex> lk(mu);
      auto it = conns.find(id);
      if (it == conns.end()) return;
      it->second->closed = true;
      it->second->pending.clear();
      conns.erase(it);
    }
    std::fprintf(stderr, "loongforge serve: connection %llu closed%s%s\n", static_cast<unsigned long long>(id),
                 why.empty() ? "" : ": ", why.c_str());
  }

  // Answers the connection's current request with the error line and closes it (openpi's server: the text, then
  // 1011 "internal error").
  void fail(Connection& c, const std::string& line) {
    std::fprintf(stderr, "loongforge serve: connection %llu: %s\n", static_cast<unsigned long long>(c.id),
                 line.c_str());
    ws->send(c.id, valid_utf8(line), false);
    ws->close(c.id, 1011, "request failed; the error is in the previous message");
  }

  void serve_one(Connection& c, Message& m) {
    std::string error;
    try {
      Request req = decode_request(m.payload.data(), m.payload.size());
      m.payload.clear();
      m.payload.shrink_to_fit();
      const auto t_infer = Clock::now();
      at::Tensor actions = runner.predict(req.observation, req.prompt, options.seed + c.served);
      const double infer = ms_since(t_infer);
      nlohmann::json timing = {{"infer_ms", ms_since(m.arrived)}};
      if (c.prev_total_ms >= 0) timing["prev_total_ms"] = c.prev_total_ms;
      const std::string reply =
          encode_reply(actions, {{"policy_timing", {{"infer_ms", infer}}}, {"server_timing", timing}});
      ws->send(c.id, reply, true);
      const double total = ms_since(m.arrived);
      c.prev_total_ms = total;
      ++c.served;
      record(total, infer);
      return;
    } catch (const Error& e) {
      error = first_line(e.what());
    } catch (const std::exception& e) {
      error = "internal error: " + first_line(e.what());
    }
    {
      std::lock_guard<std::mutex> lk(mu);
      c.closed = true;
      c.pending.clear();
      ++errors;
    }
    fail(c, error);
  }

  void record(double total, double infer) {
    std::vector<double> window;
    size_t n = 0;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (latency_ms.size() >= kKeep) {  // a server runs for days: keep the latest samples
        latency_ms.erase(latency_ms.begin(), latency_ms.begin() + kKeep / 2);
        infer_ms.erase(infer_ms.begin(), infer_ms.begin() + kKeep / 2);
        reported -= std::min(reported, kKeep / 2);
      }
      latency_ms.push_back(total);
      infer_ms.push_back(infer);
      ++requests;
      n = latency_ms.size();
      if (options.report_every <= 0 || n - reported < static_cast<size_t>(options.report_every)) return;
      window.assign(latency_ms.begin() + static_cast<std::ptrdiff_t>(reported), latency_ms.end());
      reported = n;
    }
    std::fprintf(stderr, "loongforge serve: %llu requests; the last %zu: latency p50 %.2f ms, p99 %.2f ms\n",
                 static_cast<unsigned long long>(requests), window.size(), percentile(window, 50),
                 percentile(window, 99));
  }

  void worker() {
    for (;;) {
      std::shared_ptr<Connection> c;
      Message m;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return stopping || !ready.empty(); });
        if (ready.empty()) return;
        c = ready.front();
        ready.pop_front();
        if (c->closed || c->pending.empty()) {
          c->scheduled = false;
          continue;
        }
        m = std::move(c->pending.front());
        c->pending.pop_front();
      }
      serve_one(*c, m);
      std::lock_guard<std::mutex> lk(mu);
      if (!c->closed && !c->pending.empty()) {
        ready.push_back(c);
        cv.notify_one();
      } else {
        c->scheduled = false;
      }
    }
  }

  void summary() {
    std::lock_guard<std::mutex> lk(mu);
    std::fprintf(stderr,
                 "loongforge serve: served %llu requests on %llu connections (%llu errors); latency p50 %.2f ms, "
                 "p99 %.2f ms; predict p50 %.2f ms, p99 %.2f ms\n",
                 static_cast<unsigned long long>(requests), static_cast<unsigned long long>(connections),
                 static_cast<unsigned long long>(errors), percentile(latency_ms, 50), percentile(latency_ms, 99),
                 percentile(infer_ms, 50), percentile(infer_ms, 99));
  }
};

PolicyServer::PolicyServer(train::PolicyRunner& runner, const ServeOptions& options)
    : impl_(std::make_unique<Impl>(runner, options)) {
  if (options.workers < 1) throw Error("serve: --workers must be at least 1");
  if (options.max_pending < 1) throw Error("serve: max_pending must be at least 1");
  Impl& m = *impl_;
  m.metadata = encode_json(runner.metadata());
  WebsocketOptions wo;
  wo.host = options.host;
  wo.port = options.port;
  wo.max_message_bytes = options.max_message_bytes;
  WebsocketServer::Handlers h;
  h.on_open = [&m](uint64_t id, const std::string& peer) { m.on_open(id, peer); };
  h.on_message = [&m](uint64_t id, std::string&& payload, bool) { m.on_message(id, std::move(payload)); };
  h.on_close = [&m](uint64_t id, const std::string& why) { m.on_close(id, why); };
  m.ws = std::make_unique<WebsocketServer>(wo, std::move(h));
}

PolicyServer::~PolicyServer() = default;

std::string PolicyServer::address() const { return impl_->ws->address(); }

void PolicyServer::run() {
  Impl& m = *impl_;
  std::vector<std::thread> workers;
  for (int i = 0; i < m.options.workers; ++i) workers.emplace_back([&m] { m.worker(); });
  try {
    m.ws->run();
  } catch (...) {
    {
      std::lock_guard<std::mutex> lk(m.mu);
      m.stopping = true;
    }
    m.cv.notify_all();
    for (auto& t : workers) t.join();
    throw;
  }
  {
    std::lock_guard<std::mutex> lk(m.mu);
    m.stopping = true;
    m.ready.clear();
  }
  m.cv.notify_all();
  for (auto& t : workers) t.join();
  m.summary();
}

void PolicyServer::stop() { impl_->ws->stop(); }

}  // namespace lf::serve
