// The WebSocket transport (websocket.h) through websocketpp's server on standalone Asio. Compiled as C++17 in a
// target of its own (CMakeLists.txt: loongforge_websocket) and only when the headers are there (LF_HAVE_SERVE).
#include "loongforge/serve/websocket.h"

#include "loongforge/core/error.h"

#if LF_HAVE_SERVE

#include <websocketpp/config/asio_no_tls.hpp>
#include <websocketpp/server.hpp>

#include <cstdio>
#include <exception>
#include <map>
#include <mutex>

namespace lf::serve {

bool available() { return true; }
const char* missing_message() { return ""; }

namespace {
using Server = websocketpp::server<websocketpp::config::asio>;
using Hdl = websocketpp::connection_hdl;

// "1009 (message too big)" / "1000" / "" when no code was sent.
std::string code_text(websocketpp::close::status::value code, const std::string& reason) {
  if (code == websocketpp::close::status::blank) return "";
  std::string s = std::to_string(code);
  if (!reason.empty()) s += " (" + reason + ")";
  return s;
}
}  // namespace

struct WebsocketServer::Impl {
  Server server;
  Handlers handlers;
  std::mutex mu;  // guards the maps and `stopping`
  std::map<Conn, Hdl> conns;
  std::map<Hdl, Conn, std::owner_less<Hdl>> ids;
  Conn next = 1;
  bool stopping = false;
  std::unique_ptr<asio::signal_set> signals;
  std::unique_ptr<asio::steady_timer> deadline;  // ends run() when connections do not close in time at stop
  asio::ip::tcp::endpoint bound;

  Conn id_of(Hdl h) {
    std::lock_guard<std::mutex> lk(mu);
    auto it = ids.find(h);
    return it == ids.end() ? 0 : it->second;
  }

  // On the network thread: stop listening, close every connection, and end run() once they are closed (or after
  // the close handshake's time).
  void shut_down() {
    std::vector<Hdl> open;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (stopping) return;
      stopping = true;
      for (auto& [id, h] : conns) open.push_back(h);
    }
    websocketpp::lib::error_code ec;
    if (server.is_listening()) server.stop_listening(ec);
    if (signals) signals->cancel();
    for (auto& h : open) server.close(h, websocketpp::close::status::going_away, "server shutting down", ec);
    deadline = std::make_unique<asio::steady_timer>(server.get_io_service());
    deadline->expires_after(std::chrono::seconds(3));
    deadline->async_wait([this](const asio::error_code& e) {
      if (!e) server.stop();
    });
    maybe_done();
  }

  // While stopping: the last connection closed ends run().
  void maybe_done() {
    std::lock_guard<std::mutex> lk(mu);
    if (stopping && conns.empty() && deadline) deadline->cancel();
  }

  template <class F>
  void guarded(const char* what, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "loongforge serve: %s: %s\n", what, e.what());
    } catch (...) {
      std::fprintf(stderr, "loongforge serve: %s: unknown exception\n", what);
    }
  }
};

WebsocketServer::WebsocketServer(const WebsocketOptions& options, Handlers handlers)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.handlers = std::move(handlers);
  Server& s = m.server;
  s.clear_access_channels(websocketpp::log::alevel::all);
  s.clear_error_channels(websocketpp::log::elevel::all);
  s.init_asio();
  s.set_reuse_addr(true);
  s.set_max_message_size(options.max_message_bytes);
  s.set_max_http_body_size(64 << 10);
  s.set_close_handshake_timeout(2000);

  s.set_open_handler([&m](Hdl h) {
    m.guarded("open", [&] {
      Conn id;
      {
        std::lock_guard<std::mutex> lk(m.mu);
        id = m.next++;
        m.conns[id] = h;
        m.ids[h] = id;
      }
      std::string peer = m.server.get_con_from_hdl(h)->get_remote_endpoint();
      if (m.handlers.on_open) m.handlers.on_open(id, peer);
    });
  });
  s.set_message_handler([&m](Hdl h, Server::message_ptr msg) {
    m.guarded("message", [&] {
      Conn id = m.id_of(h);
      if (!id || !m.handlers.on_message) return;
      bool binary = msg->get_opcode() == websocketpp::frame::opcode::binary;
      m.handlers.on_message(id, std::move(msg->get_raw_payload()), binary);
    });
  });
  auto closed = [&m](Hdl h) {
    m.guarded("close", [&] {
      Conn id = 0;
      {
        std::lock_guard<std::mutex> lk(m.mu);
        auto it = m.ids.find(h);
        if (it != m.ids.end()) {
          id = it->second;
          m.conns.erase(id);
          m.ids.erase(it);
        }
      }
      if (id && m.handlers.on_close) {
        auto con = m.server.get_con_from_hdl(h);
        std::string why = code_text(con->get_local_close_code(), con->get_local_close_reason());
        if (con->get_local_close_code() == websocketpp::close::status::abnormal_close)
          why = "the peer went away without a close frame (1006)";
        else if (why.empty() && con->get_ec())
          why = con->get_ec().message();
        m.handlers.on_close(id, why);
      }
      m.maybe_done();
    });
  };
  s.set_close_handler(closed);
  s.set_fail_handler(closed);
  // Plain HTTP: GET /healthz is the health check openpi's server answers; anything else says what this is.
  s.set_http_handler([&m](Hdl h) {
    m.guarded("http", [&] {
      auto con = m.server.get_con_from_hdl(h);
      if (con->get_resource() == "/healthz") {
        con->set_status(websocketpp::http::status_code::ok);
        con->set_body("OK\n");
      } else {
        con->set_status(websocketpp::http::status_code::upgrade_required);
        con->set_body("a LoongForge policy server: connect with a WebSocket client (openpi-client)\n");
      }
    });
  });

  const std::string where = options.host + ":" + std::to_string(options.port);
  asio::error_code aec;
  asio::ip::address addr = asio::ip::make_address(options.host, aec);
  asio::ip::tcp::endpoint ep;
  if (!aec) {
    ep = asio::ip::tcp::endpoint(addr, static_cast<unsigned short>(options.port));
  } else {
    asio::ip::tcp::resolver resolver(s.get_io_service());
    auto found = resolver.resolve(options.host, std::to_string(options.port), aec);
    if (aec || found.empty())
      throw Error("serve: --host '" + options.host + "': cannot resolve (" + aec.message() + ")");
    ep = found.begin()->endpoint();
  }
  websocketpp::lib::error_code ec;
  s.listen(ep, ec);
  if (ec) throw Error("serve: cannot listen on " + where + ": " + ec.message());
  m.bound = s.get_local_endpoint(aec);
  s.start_accept(ec);
  if (ec) throw Error("serve: cannot accept on " + where + ": " + ec.message());

  if (options.stop_on_signals) {
    m.signals = std::make_unique<asio::signal_set>(s.get_io_service(), SIGINT, SIGTERM);
    m.signals->async_wait([&m](const asio::error_code& e, int) {
      if (!e) m.shut_down();
    });
  }
}

WebsocketServer::~WebsocketServer() = default;

int WebsocketServer::port() const { return impl_->bound.port(); }

std::string WebsocketServer::address() const {
  const auto& a = impl_->bound.address();
  std::string host = a.to_string();
  if (a.is_v6()) host = "[" + host + "]";
  return host + ":" + std::to_string(impl_->bound.port());
}

void WebsocketServer::run() { impl_->server.run(); }

void WebsocketServer::stop() {
  asio::post(impl_->server.get_io_service(), [m = impl_.get()] { m->shut_down(); });
}

bool WebsocketServer::send(Conn conn, const std::string& payload, bool binary) {
  Hdl h;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    auto it = impl_->conns.find(conn);
    if (it == impl_->conns.end()) return false;
    h = it->second;
  }
  websocketpp::lib::error_code ec;
  impl_->server.send(h, payload,
                     binary ? websocketpp::frame::opcode::binary : websocketpp::frame::opcode::text, ec);
  return !ec;
}

void WebsocketServer::close(Conn conn, int code, const std::string& reason) {
  Hdl h;
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    auto it = impl_->conns.find(conn);
    if (it == impl_->conns.end()) return;
    h = it->second;
  }
  websocketpp::lib::error_code ec;
  // a close frame's reason holds at most 123 bytes
  impl_->server.close(h, static_cast<websocketpp::close::status::value>(code), reason.substr(0, 120), ec);
}

}  // namespace lf::serve

#else  // no websocketpp / Asio / msgpack-cxx headers in this build

namespace lf::serve {

bool available() { return false; }
const char* missing_message() {
  return "this build has no policy server: install libwebsocketpp-dev libasio-dev libmsgpack-cxx-dev "
         "(scripts/setup.sh does) and rebuild";
}

struct WebsocketServer::Impl {};
WebsocketServer::WebsocketServer(const WebsocketOptions&, Handlers) { throw Error(missing_message()); }
WebsocketServer::~WebsocketServer() = default;
int WebsocketServer::port() const { return 0; }
std::string WebsocketServer::address() const { return ""; }
void WebsocketServer::run() {}
void WebsocketServer::stop() {}
bool WebsocketServer::send(Conn, const std::string&, bool) { return false; }
void WebsocketServer::close(Conn, int, const std::string&) {}

}  // namespace lf::serve

#endif
