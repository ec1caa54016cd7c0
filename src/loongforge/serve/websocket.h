// A WebSocket server (RFC 6455) for the policy server: binary and text messages both ways, several connections at
// once, a bound on the size of a message, GET /healthz answered with 200 OK (as openpi's server does). Through
// websocketpp on standalone Asio; torch-free, and the one file that includes websocketpp's headers (websocket.cpp,
// compiled as C++17: websocketpp 0.8 does not compile as C++20). A build without those headers has no server
// (available() is false and the constructor throws one line saying what to install).
//
// Threads: the network runs on run()'s thread (or threads); the handlers are called there and must not block
// (hand slow work to threads of one's own). send() and close() may be called from any thread.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace lf::serve {

// Whether this build has the WebSocket server (websocketpp + Asio + msgpack-cxx headers were found).
bool available();
// What to install when it has not.
const char* missing_message();

struct WebsocketOptions {
  std::string host = "127.0.0.1";  // an address or a name; 0.0.0.0 / :: for every interface
  int port = 8000;                 // 0: the system picks one (port() says which)
  size_t max_message_bytes = 64u << 20;  // a bigger message closes its connection (1009, "message too big")
  bool stop_on_signals = true;     // SIGINT / SIGTERM stop run() (connections are closed with 1001 first)
};

class WebsocketServer {
 public:
  using Conn = uint64_t;  // a connection's id, never reused within a server
  struct Handlers {
    std::function<void(Conn, const std::string& peer)> on_open;       // the handshake is done
    std::function<void(Conn, std::string&& payload, bool binary)> on_message;
    std::function<void(Conn, const std::string& why)> on_close;       // after the last on_message of that Conn
  };

  // Binds and listens (errors, e.g. a port in use or an unknown host, are one-line lf::Errors).
  WebsocketServer(const WebsocketOptions& options, Handlers handlers);
  ~WebsocketServer();
  WebsocketServer(const WebsocketServer&) = delete;
  WebsocketServer& operator=(const WebsocketServer&) = delete;

  int port() const;          // the bound port
  std::string address() const;  // the bound address, as "host:port" ("[::1]:port" for IPv6)

  // Serves until stop() (or a signal, with stop_on_signals); returns once every connection is closed.
  void run();
  // Stops accepting, closes the open connections (1001 "going away") and makes run() return. Any thread.
  void stop();

  // Sends one message on a connection; false when it is closed (or closing). Any thread.
  bool send(Conn conn, const std::string& payload, bool binary);
  // Closes a connection with a close code (1000 normal, 1011 internal error, ...) and a reason. Any thread.
  void close(Conn conn, int code, const std::string& reason);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lf::serve
