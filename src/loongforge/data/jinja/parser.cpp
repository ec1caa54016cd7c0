#include "loongforge/data/jinja/parser.h"

#include <set>

#include "loongforge/data/jinja/lexer.h"

namespace lf::data::jinja {

namespace {

// ------------------------------------------------------------------------------------------------ expressions

const std::set<std::string>& filters() {
  static const std::set<std::string> f = {
      "abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e", "escape", "first", "float", "indent",
      "int", "items", "join", "last", "length", "list", "lower", "map", "max", "min", "reject", "rejectattr",
      "replace", "reverse", "round", "safe", "select", "selectattr", "sort", "string", "sum", "title", "tojson",
      "trim", "unique", "upper", "wordcount"};
  return f;
}
const std::set<std::string>& tests() {
  static const std::set<std::string> t = {
      "boolean", "callable", "defined", "divisibleby", "eq", "equalto", "even", "false", "float", "ge", "gt", "in",
      "integer", "iterable", "le", "lower", "lt", "mapping", "ne", "none", "number", "odd", "sameas", "sequence",
      "string", "true", "undefined", "upper", "==", "!=", "<", ">", "<=", ">="};
  return t;
}

class ExprParser {
 public:
  ExprParser(std::vector<Tok> toks, const std::string& origin) : t_(std::move(toks)), origin_(origin) {}

  const Tok& cur() const { return t_[p_]; }
  const Tok& peek(size_t n = 1) const { return t_[std::min(p_ + n, t_.size() - 1)]; }
  bool is_op(const char* s) const { return cur().k == Tok::Op && cur().s == s; }
  bool is_name(const char* s) const { return cur().k == Tok::Name && cur().s == s; }
  bool at_end() const { return cur().k == Tok::End; }
  bool accept_op(const char* s) { return is_op(s) ? (++p_, true) : false; }
  bool accept_name(const char* s) { return is_name(s) ? (++p_, true) : false; }
  [[noreturn]] void fail(const std::string& what) const { syntax_error(origin_, cur().line, what); }
  std::string describe() const {
    switch (cur().k) {
      case Tok::End: return "end of tag";
      case Tok::Str: return "string literal";
      case Tok::Int: case Tok::Float: return "number";
      default: return "'" + cur().s + "'";
    }
  }
  void expect_op(const char* s) {
    if (!accept_op(s)) fail(std::string("expected '") + s + "', got " + describe());
  }
  std::string expect_name() {
    if (cur().k != Tok::Name) fail("expected a name, got " + describe());
    return t_[p_++].s;
  }
  void expect_end() {
    if (!at_end()) fail("unexpected " + describe());
  }

  EP node(Expr::K k, int line) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->line = line;
    return e;
  }

  // Nesting bound: a template is untrusted input, and each level of ( [ { not - is a C++ call here and later.
  static constexpr int kMaxDepth = 300;  // about 100 levels of brackets (three calls each)
  struct Deeper {
    ExprParser& p;
    explicit Deeper(ExprParser& x) : p(x) {
      if (++p.depth_ > kMaxDepth) p.fail("expression nested more than " + std::to_string(kMaxDepth) + " levels deep");
    }
    ~Deeper() { --p.depth_; }
  };

  EP expr(bool with_cond = true) {
    Deeper deeper(*this);
    EP e = or_expr();
    while (with_cond && is_name("if")) {
      int line = cur().line;
      ++p_;
      EP c = or_expr();
      EP other = accept_name("else") ? expr() : nullptr;
      EP n = node(Expr::Cond, line);
      n->a.push_back(std::move(e));
      n->a.push_back(std::move(c));
      n->a.push_back(std::move(other));
      e = std::move(n);
    }
    return e;
  }

 private:
  EP binary(Expr::K k, std::string op, EP l, EP r, int line) {
    EP n = node(k, line);
    n->name = std::move(op);
    n->a.push_back(std::move(l));
    n->a.push_back(std::move(r));
    return n;
  }
  EP or_expr() {
    EP e = and_expr();
    while (is_name("or")) {
      int line = cur().line;
      ++p_;
      e = binary(Expr::Or, "or", std::move(e), and_expr(), line);
    }
    return e;
  }
  EP and_expr() {
    EP e = not_expr();
    while (is_name("and")) {
      int line = cur().line;
      ++p_;
      e = binary(Expr::And, "and", std::move(e), not_expr(), line);
    }
    return e;
  }
  EP not_expr() {
    Deeper deeper(*this);
    if (is_name("not")) {
      EP n = node(Expr::Not, cur().line);
      ++p_;
      n->a.push_back(not_expr());
      return n;
    }
    return compare();
  }
  EP compare() {
    int line = cur().line;
    EP first = math1();
    EP n;
    while (true) {
      std::string op;
      if (cur().k == Tok::Op && (cur().s == "==" || cur().s == "!=" || cur().s == "<" || cur().s == "<=" ||
                                 cur().s == ">" || cur().s == ">=")) {
        op = cur().s;
        ++p_;
      } else if (is_name("in")) {
        op = "in";
        ++p_;
      } else if (is_name("not") && peek().k == Tok::Name && peek().s == "in") {
        op = "notin";
        p_ += 2;
      } else {
        break;
      }
      if (!n) {
        n = node(Expr::Cmp, line);
        n->a.push_back(std::move(first));
      }
      n->ops.push_back(op);
      n->a.push_back(math1());
    }
    return n ? std::move(n) : std::move(first);
  }
  EP math1() {
    EP e = concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().s;
      int line = cur().line;
      ++p_;
      e = binary(Expr::Bin, op, std::move(e), concat(), line);
    }
    return e;
  }
  EP concat() {
    EP e = math2();
    while (is_op("~")) {
      int line = cur().line;
      ++p_;
      e = binary(Expr::Bin, "~", std::move(e), math2(), line);
    }
    return e;
  }
  EP math2() {
    EP e = pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().s;
      int line = cur().line;
      ++p_;
      e = binary(Expr::Bin, op, std::move(e), pow(), line);
    }
    return e;
  }
  EP pow() {
    EP e = unary(true);
    while (is_op("**")) {
      int line = cur().line;
      ++p_;
      e = binary(Expr::Bin, "**", std::move(e), unary(true), line);
    }
    return e;
  }
  EP unary(bool with_filter) {
    Deeper deeper(*this);
    EP e;
    if (is_op("-") || is_op("+")) {
      e = node(is_op("-") ? Expr::Neg : Expr::Pos, cur().line);
      ++p_;
      e->a.push_back(unary(false));
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    return with_filter ? filter_expr(std::move(e)) : std::move(e);
  }
  EP lit(Value v, int line) {
    EP e = node(Expr::Lit, line);
    e->lit = std::move(v);
    return e;
  }
  EP primary() {
    const Tok& t = cur();
    int line = t.line;
    switch (t.k) {
      case Tok::Name: {
        ++p_;
        if (t.s == "true" || t.s == "True") return lit(Value::boolean(true), line);
        if (t.s == "false" || t.s == "False") return lit(Value::boolean(false), line);
        if (t.s == "none" || t.s == "None") return lit(Value::none(), line);
        EP e = node(Expr::Name, line);
        e->name = t.s;
        return e;
      }
      case Tok::Str: {
        std::string s;
        while (cur().k == Tok::Str) s += t_[p_++].s;
        return lit(Value::str(s), line);
      }
      case Tok::Int: ++p_; return lit(Value::integer(t.i), line);
      case Tok::Float: ++p_; return lit(Value::real(t.f), line);
      case Tok::Op:
        if (accept_op("(")) {
          if (accept_op(")")) {
            EP l = node(Expr::ListL, line);
            l->name = "tuple";
            return l;
          }
          EP e = expr();
          if (is_op(",")) {  // tuple: evaluated as a list
            EP l = node(Expr::ListL, line);
            l->name = "tuple";
            l->a.push_back(std::move(e));
            while (accept_op(",") && !is_op(")")) l->a.push_back(expr());
            e = std::move(l);
          }
          expect_op(")");
          return e;
        }
        if (accept_op("[")) {
          EP l = node(Expr::ListL, line);
          while (!is_op("]")) {
            l->a.push_back(expr());
            if (!accept_op(",")) break;
          }
          expect_op("]");
          return l;
        }
        if (accept_op("{")) {
          EP d = node(Expr::DictL, line);
          while (!is_op("}")) {
            d->a.push_back(expr());
            expect_op(":");
            d->a.push_back(expr());
            if (!accept_op(",")) break;
          }
          expect_op("}");
          return d;
        }
        [[fallthrough]];
      default: fail("unexpected " + describe());
    }
  }
  void call_args(Expr& n) {  // after '('
    while (!is_op(")")) {
      if (cur().k == Tok::Name && peek().k == Tok::Op && peek().s == "=") {
        std::string k = cur().s;
        p_ += 2;
        n.kw.emplace_back(k, expr());
      } else {
        if (!n.kw.empty()) fail("positional argument after keyword argument");
        n.a.push_back(expr());
      }
      if (!accept_op(",")) break;
    }
    expect_op(")");
  }
  EP postfix(EP e) {
    while (true) {
      int line = cur().line;
      if (accept_op(".")) {
        if (cur().k == Tok::Int) {
          EP n = node(Expr::Item, line);
          n->a.push_back(std::move(e));
          n->a.push_back(lit(Value::integer(cur().i), line));
          ++p_;
          e = std::move(n);
        } else {
          EP n = node(Expr::Attr, line);
          n->name = expect_name();
          n->a.push_back(std::move(e));
          e = std::move(n);
        }
      } else if (accept_op("[")) {
        EP parts[3];
        bool slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!is_op(":") && !is_op("]")) parts[k] = expr();
          if (k < 2 && accept_op(":")) slice = true;
          else break;
        }
        expect_op("]");
        EP n = node(slice ? Expr::Slice : Expr::Item, line);
        n->a.push_back(std::move(e));
        if (!slice && !parts[0]) fail("empty subscript");
        for (int k = 0; k < (slice ? 3 : 1); ++k) n->a.push_back(std::move(parts[k]));
        e = std::move(n);
      } else if (accept_op("(")) {
        EP n = node(Expr::Call, line);
        n->a.push_back(std::move(e));
        call_args(*n);
        e = std::move(n);
      } else {
        return e;
      }
    }
  }
  EP filter_expr(EP e) {
    while (true) {
      int line = cur().line;
      if (accept_op("|")) {
        EP n = node(Expr::Filter, line);
        n->name = expect_name();
        if (!known_filter(n->name)) syntax_error(origin_, line, "unknown filter '" + n->name + "'");
        n->a.push_back(std::move(e));
        if (accept_op("(")) call_args(*n);
        e = std::move(n);
      } else if (accept_name("is")) {
        EP n = node(Expr::Test, line);
        n->negate = accept_name("not");
        if (cur().k == Tok::Op && tests().count(cur().s)) n->name = t_[p_++].s;
        else n->name = expect_name();
        if (!known_test(n->name)) syntax_error(origin_, line, "unknown test '" + n->name + "'");
        n->a.push_back(std::move(e));
        if (accept_op("(")) {
          call_args(*n);
        } else if ((cur().k == Tok::Name || cur().k == Tok::Str || cur().k == Tok::Int || cur().k == Tok::Float ||
                    is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and") && !is_name("if")) {
          n->a.push_back(postfix(primary()));
        }
        e = std::move(n);
      } else if (accept_op("(")) {
        EP n = node(Expr::Call, line);
        n->a.push_back(std::move(e));
        call_args(*n);
        e = std::move(n);
      } else {
        return e;
      }
    }
  }

  std::vector<Tok> t_;
  size_t p_ = 0;
  int depth_ = 0;
  const std::string& origin_;
};

// ------------------------------------------------------------------------------------------------ statements

class TemplateParser {
 public:
  TemplateParser(std::vector<Seg> segs, const std::string& origin) : segs_(std::move(segs)), origin_(origin) {}

  // Parses statements until one of `ends` (a block tag keyword); returns it (its parser is left in `tag_`).
  std::string body(Body& out, const std::vector<std::string>& ends, const std::string& opener, int open_line) {
    while (i_ < segs_.size()) {
      const Seg& s = segs_[i_++];
      if (s.k == Seg::Text) {
        auto st = stmt(Stmt::Text, s.line);
        st->text = s.text;
        out.push_back(std::move(st));
        continue;
      }
      auto tp = std::make_unique<ExprParser>(tokenize(s.text, s.line, origin_), origin_);
      if (s.k == Seg::Var) {
        auto st = stmt(Stmt::Out, s.line);
        if (tp->at_end()) tp->fail("empty expression");
        st->e.push_back(tp->expr());
        tp->expect_end();
        out.push_back(std::move(st));
        continue;
      }
      std::string kw = tp->expect_name();
      for (const auto& e : ends)
        if (kw == e) {
          tag_ = std::move(tp);
          return kw;
        }
      tag_ = std::move(tp);
      block(out, kw, s.line);
    }
    if (!ends.empty())
      syntax_error(origin_, open_line, "unclosed '" + opener + "' block: missing '{% " + ends.back() + " %}'");
    return "";
  }

 private:
  SP stmt(Stmt::K k, int line) {
    auto s = std::make_unique<Stmt>();
    s->k = k;
    s->line = line;
    return s;
  }

  void block(Body& out, const std::string& kw, int line) {
    if (++block_depth_ > 100) syntax_error(origin_, line, "blocks nested more than 100 levels deep");
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{block_depth_};
    ExprParser& tp = *tag_;
    if (kw == "if") {
      auto st = stmt(Stmt::If, line);
      st->e.push_back(tp.expr());
      tp.expect_end();
      while (true) {
        st->bodies.emplace_back();
        std::string end = body(st->bodies.back(), {"elif", "else", "endif"}, "if", line);
        if (end == "elif") {
          tag_->at_end() ? tag_->fail("elif without a condition") : void();
          st->e.push_back(tag_->expr());
          tag_->expect_end();
        } else if (end == "else") {
          tag_->expect_end();
          st->bodies.emplace_back();
          body(st->bodies.back(), {"endif"}, "if", line);
          tag_->expect_end();
          break;
        } else {
          tag_->expect_end();
          break;
        }
      }
      out.push_back(std::move(st));
    } else if (kw == "for") {
      auto st = stmt(Stmt::For, line);
      bool paren = tp.accept_op("(");
      do st->names.push_back(tp.expect_name());
      while (tp.accept_op(","));
      if (paren) tp.expect_op(")");
      if (!tp.accept_name("in")) tp.fail("expected 'in', got " + tp.describe());
      st->e.push_back(tp.expr(false));
      st->e.push_back(tp.accept_name("if") ? tp.expr() : nullptr);
      if (tp.is_name("recursive")) tp.fail("recursive loops are not supported");
      tp.expect_end();
      st->bodies.resize(2);
      if (body(st->bodies[0], {"else", "endfor"}, "for", line) == "else") {
        tag_->expect_end();
        body(st->bodies[1], {"endfor"}, "for", line);
      }
      tag_->expect_end();
      out.push_back(std::move(st));
    } else if (kw == "set") {
      auto st = stmt(Stmt::Set, line);
      st->names.push_back(tp.expect_name());
      if (tp.accept_op(".")) {
        st->text = tp.expect_name();
      } else {
        while (tp.accept_op(",")) st->names.push_back(tp.expect_name());
      }
      if (tp.accept_op("=")) {
        EP v = tp.expr();
        if (tp.is_op(",")) {
          auto l = std::make_unique<Expr>();
          l->k = Expr::ListL;
          l->name = "tuple";
          l->line = line;
          l->a.push_back(std::move(v));
          while (tp.accept_op(",")) l->a.push_back(tp.expr());
          v = std::move(l);
        }
        st->e.push_back(std::move(v));
        tp.expect_end();
      } else {
        if (st->names.size() != 1 || !st->text.empty()) tp.fail("block set needs a single name");
        tp.expect_end();
        st->k = Stmt::SetBlock;
        st->bodies.emplace_back();
        body(st->bodies[0], {"endset"}, "set", line);
        tag_->expect_end();
      }
      out.push_back(std::move(st));
    } else if (kw == "macro") {
      auto st = stmt(Stmt::Macro, line);
      st->text = tp.expect_name();
      tp.expect_op("(");
      while (!tp.is_op(")")) {
        st->names.push_back(tp.expect_name());
        st->defaults.push_back(tp.accept_op("=") ? tp.expr() : nullptr);
        if (!tp.accept_op(",")) break;
      }
      tp.expect_op(")");
      tp.expect_end();
      st->bodies.emplace_back();
      body(st->bodies[0], {"endmacro"}, "macro", line);
      tag_->accept_name(st->text.c_str());
      tag_->expect_end();
      out.push_back(std::move(st));
    } else if (kw == "break" || kw == "continue") {
      tp.expect_end();
      out.push_back(stmt(kw == "break" ? Stmt::Break : Stmt::Continue, line));
    } else if (kw == "generation") {  // transformers' assistant-mask extension: renders its body
      tp.expect_end();
      body(out, {"endgeneration"}, "generation", line);
      tag_->expect_end();
    } else if (kw.rfind("end", 0) == 0 || kw == "elif" || kw == "else") {
      syntax_error(origin_, line, "unexpected '{% " + kw + " %}'");
    } else {
      syntax_error(origin_, line, "unsupported tag '" + kw + "'");
    }
  }

  std::vector<Seg> segs_;
  size_t i_ = 0;
  const std::string& origin_;
  std::unique_ptr<ExprParser> tag_;
  int block_depth_ = 0;
};

}  // namespace

bool known_filter(const std::string& name) { return filters().count(name) > 0; }
bool known_test(const std::string& name) { return tests().count(name) > 0; }

std::shared_ptr<Program> parse(const std::string& source, const std::string& origin) {
  auto prog = std::make_shared<Program>();
  prog->origin = origin;
  TemplateParser tp(split_segments(source, origin), prog->origin);
  tp.body(prog->body, {}, "", 0);
  return prog;
}

}  // namespace lf::data::jinja
