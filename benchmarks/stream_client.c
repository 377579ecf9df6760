/* A load client for bench_gateway.py: batches of simultaneous streamed POSTs over keep-alive
 * HTTP/1.1 connections, timed to the first event with text and to the end of the stream.
 *
 * Why C: on a small machine the client shares a core with the control plane, so every
 * microsecond it spends is taken from the gateway path alone. The Python client (asyncio,
 * hotpool's lean stream client) costs ~1 ms of CPU per 16-token stream there; this one costs
 * a few microseconds per event, so what the comparison measures is the server side.
 *
 * Usage (bench_gateway.py drives it; one process, connections kept between batches):
 *
 *   stream_client TIMEOUT_S --target NAME MODE HOST PORT PATH AUTHORIZATION BODY_FILE ...
 *
 * MODE is "sse" (OpenAI-style server-sent events, ending with "data: [DONE]") or "ndjson"
 * (a hotpool worker's events, the last one with a finish_reason). In the body, every
 * "@@REQUEST_ID@@" becomes a fresh id per request. Each line on stdin, "NAME COUNT", starts
 * COUNT requests to NAME at once; when all have ended, stdout gets one line per request, in
 * order, then "end":
 *
 *   ttft_s|-  total_s  completion_tokens  request_id|-  error|-     (tab-separated)
 *
 * ttft is to the first event whose "text" is not empty; completion_tokens come from the
 * usage chunk (sse) or the finishing event (ndjson); request_id is the response's
 * x-hotpool-request-id header. Markers are found without decoding JSON: JSON escapes the
 * quotes inside strings, so no generated text can contain them.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_TARGETS 8
#define PLACEHOLDER "@@REQUEST_ID@@"
#define ERR_LEN 240

typedef struct Conn Conn;

typedef struct {
  char name[32];
  int sse;
  struct sockaddr_storage addr;
  socklen_t addr_len;
  char *head; /* request line and headers up to content-length's value */
  char *body;
  size_t body_len;
  Conn **idle;
  int n_idle, cap_idle;
} Target;

enum { S_HEAD, S_SIZE, S_DATA, S_DATA_CRLF, S_TRAILER, S_LENGTH, S_DONE };

struct Conn {
  int fd;
  Target *t;
  char *out;
  size_t out_len, out_off;
  char *in;
  size_t in_len, in_cap;
  char *line;
  size_t line_len, line_cap;
  int state, chunked, keep_alive, status, reused, got_bytes;
  long remaining;
  /* the request's results */
  int slot;
  double t0, deadline, ttft, total;
  long tokens;
  int finished, done_marker;
  char rid[128];
  char err[ERR_LEN];
  char errbody[201];
  size_t errbody_len;
};

typedef struct {
  double ttft, total;
  long tokens;
  char rid[128];
  char err[ERR_LEN];
} Result;

static Target targets[MAX_TARGETS];
static int n_targets;
static double timeout_s;
static int ep;
static unsigned long long id_seed, id_counter;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what) {
  perror(what);
  exit(2);
}

static void *xrealloc(void *p, size_t n) {
  void *q = realloc(p, n);
  if (!q) die("realloc");
  return q;
}

static void grow(char **buf, size_t *cap, size_t need) {
  if (need <= *cap) return;
  size_t c = *cap ? *cap : 4096;
  while (c < need) c *= 2;
  *buf = xrealloc(*buf, c);
  *cap = c;
}

/* A JSON string value after `key` (e.g. "\"message\": \""), unescaped roughly, into dst. */
static void json_string_after(const char *l, size_t n, const char *key, char *dst, size_t cap) {
  const char *p = memmem(l, n, key, strlen(key));
  size_t k = 0;
  if (p) {
    const char *end = l + n;
    for (p += strlen(key); p < end && *p != '"' && k + 1 < cap; p++) {
      if (*p == '\\' && p + 1 < end) p++;
      dst[k++] = (*p == '\t' || *p == '\n' || *p == '\r') ? ' ' : *p;
    }
  }
  if (!k) k = (size_t)snprintf(dst, cap, "(no message)");
  dst[k] = 0;
}

static long number_after(const char *l, size_t n, const char *key) {
  const char *p = memmem(l, n, key, strlen(key));
  return p ? strtol(p + strlen(key), NULL, 10) : -1;
}

static int has_text(const char *l, size_t n) {
  static const char key[] = "\"text\": \"";
  const char *p = memmem(l, n, key, sizeof key - 1);
  return p && p + sizeof key - 1 < l + n && p[sizeof key - 1] != '"';
}

static void on_line(Conn *c, const char *l, size_t n) {
  if (c->status != 200) return;
  if (c->t->sse) {
    if (n < 6 || memcmp(l, "data: ", 6) != 0) return;
    if (n == 12 && memcmp(l, "data: [DONE]", 12) == 0) {
      c->done_marker = 1;
      return;
    }
    if (n >= 14 && memcmp(l, "data: {\"error\"", 14) == 0) {
      json_string_after(l, n, "\"message\": \"", c->err, sizeof c->err);
      return;
    }
    if (c->ttft < 0 && has_text(l, n)) c->ttft = now() - c->t0;
    const char *u = memmem(l, n, "\"usage\": {", 10);
    if (u) c->tokens = number_after(u, (size_t)(l + n - u), "\"completion_tokens\": ");
  } else {
    if (c->ttft < 0 && has_text(l, n)) c->ttft = now() - c->t0;
    if (memmem(l, n, "\"finish_reason\": null", 21)) return;
    c->finished = 1;
    c->tokens = number_after(l, n, "\"completion_tokens\": ");
    if (memmem(l, n, "\"finish_reason\": \"error\"", 24))
      json_string_after(l, n, "\"error\": \"", c->err, sizeof c->err);
  }
}

static void on_body(Conn *c, const char *p, size_t n) {
  if (c->status != 200) {
    size_t k = n < 200 - c->errbody_len ? n : 200 - c->errbody_len;
    memcpy(c->errbody + c->errbody_len, p, k);
    c->errbody_len += k;
    return;
  }
  const char *end = p + n;
  while (p < end) {
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    size_t k = (size_t)((nl ? nl : end) - p);
    if (!nl) { /* a partial line: keep it for the next read */
      grow(&c->line, &c->line_cap, c->line_len + k);
      memcpy(c->line + c->line_len, p, k);
      c->line_len += k;
      return;
    }
    if (c->line_len) {
      grow(&c->line, &c->line_cap, c->line_len + k);
      memcpy(c->line + c->line_len, p, k);
      on_line(c, c->line, c->line_len + k);
      c->line_len = 0;
    } else {
      on_line(c, p, k);
    }
    p = nl + 1;
  }
}

static void parse_head(Conn *c, const char *h, size_t n) {
  c->status = 0;
  if (n > 12 && memcmp(h, "HTTP/1.", 7) == 0) c->status = atoi(h + 9);
  c->chunked = 0;
  c->remaining = -1;
  c->keep_alive = 1;
  const char *end = h + n;
  const char *p = memchr(h, '\n', n);
  while (p && ++p < end) {
    const char *eol = memchr(p, '\n', (size_t)(end - p));
    size_t k = (size_t)((eol ? eol : end) - p);
    while (k && (p[k - 1] == '\r' || p[k - 1] == '\n')) k--;
    const char *colon = memchr(p, ':', k);
    if (colon) {
      size_t name = (size_t)(colon - p);
      const char *v = colon + 1;
      while (v < p + k && *v == ' ') v++;
      size_t vlen = (size_t)(p + k - v);
      if (name == 17 && strncasecmp(p, "transfer-encoding", 17) == 0)
        c->chunked = vlen >= 7 && strncasecmp(v, "chunked", 7) == 0;
      else if (name == 14 && strncasecmp(p, "content-length", 14) == 0)
        c->remaining = strtol(v, NULL, 10);
      else if (name == 10 && strncasecmp(p, "connection", 10) == 0)
        c->keep_alive = !(vlen >= 5 && strncasecmp(v, "close", 5) == 0);
      else if (name == 20 && strncasecmp(p, "x-hotpool-request-id", 20) == 0) {
        size_t m = vlen < sizeof c->rid - 1 ? vlen : sizeof c->rid - 1;
        memcpy(c->rid, v, m);
        c->rid[m] = 0;
      }
    }
    p = eol;
  }
  c->state = c->chunked ? S_SIZE : S_LENGTH;
  if (!c->chunked && c->remaining < 0) c->keep_alive = 0; /* body to EOF */
}

/* Parse what is in c->in; returns 1 once the response is complete. */
static int parse(Conn *c) {
  size_t pos = 0;
  int complete = 0;
  while (pos < c->in_len && !complete) {
    char *p = c->in + pos;
    size_t avail = c->in_len - pos;
    if (c->state == S_HEAD) {
      char *e = memmem(p, avail, "\r\n\r\n", 4);
      if (!e) break;
      parse_head(c, p, (size_t)(e - p) + 2);
      pos += (size_t)(e - p) + 4;
      if (!c->chunked && c->remaining == 0) complete = 1;
    } else if (c->state == S_SIZE || c->state == S_TRAILER) {
      char *e = memmem(p, avail, "\r\n", 2);
      if (!e) break;
      pos += (size_t)(e - p) + 2;
      if (c->state == S_TRAILER) {
        if (e == p) complete = 1; /* the blank line after the last chunk */
        continue;
      }
      c->remaining = strtol(p, NULL, 16);
      c->state = c->remaining ? S_DATA : S_TRAILER;
    } else if (c->state == S_DATA || c->state == S_LENGTH) {
      size_t k = avail < (size_t)c->remaining ? avail : (size_t)c->remaining;
      if (c->remaining < 0) k = avail; /* S_LENGTH without a length: to EOF */
      on_body(c, p, k);
      pos += k;
      if (c->remaining >= 0) c->remaining -= (long)k;
      if (c->remaining == 0) {
        if (c->state == S_LENGTH) complete = 1;
        else c->state = S_DATA_CRLF;
      }
    } else if (c->state == S_DATA_CRLF) {
      if (avail < 2) break;
      pos += 2;
      c->state = S_SIZE;
    }
  }
  memmove(c->in, c->in + pos, c->in_len - pos);
  c->in_len -= pos;
  if (complete) c->state = S_DONE;
  return complete;
}

static void watch(Conn *c, int op) {
  struct epoll_event ev = {.events = EPOLLIN | (c->out_off < c->out_len ? EPOLLOUT : 0),
                           .data.ptr = c};
  if (epoll_ctl(ep, op, c->fd, &ev) != 0) die("epoll_ctl");
}

static int open_socket(Target *t) {
  int fd = socket(t->addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) die("socket");
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (connect(fd, (struct sockaddr *)&t->addr, t->addr_len) != 0 && errno != EINPROGRESS)
    die("connect");
  return fd;
}

/* An idle connection that the server has not closed, or a new one. */
static Conn *take_conn(Target *t) {
  while (t->n_idle) {
    Conn *c = t->idle[--t->n_idle];
    char b;
    ssize_t r = recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      c->reused = 1;
      return c;
    }
    close(c->fd); /* closed by the server (or stray bytes): drop it */
    free(c->out), free(c->in), free(c->line), free(c);
  }
  Conn *c = calloc(1, sizeof *c);
  if (!c) die("calloc");
  c->t = t;
  c->fd = open_socket(t);
  return c;
}

static void start(Conn *c, int slot, double t0) {
  Target *t = c->t;
  char id[40];
  snprintf(id, sizeof id, "%016llx%016llx", id_seed, ++id_counter);
  /* the body, with each placeholder replaced by the id */
  size_t ph = strlen(PLACEHOLDER), idn = strlen(id), n = 0;
  char *body = malloc(t->body_len * 3 + 64);
  if (!body) die("malloc");
  for (size_t i = 0; i < t->body_len;) {
    if (i + ph <= t->body_len && memcmp(t->body + i, PLACEHOLDER, ph) == 0) {
      memcpy(body + n, id, idn), n += idn, i += ph;
    } else {
      body[n++] = t->body[i++];
    }
  }
  free(c->out);
  c->out = malloc(strlen(t->head) + n + 64);
  if (!c->out) die("malloc");
  c->out_len = (size_t)sprintf(c->out, "%s%zu\r\n\r\n", t->head, n);
  memcpy(c->out + c->out_len, body, n);
  c->out_len += n;
  c->out_off = 0;
  free(body);
  c->slot = slot;
  c->t0 = t0;
  c->deadline = t0 + timeout_s;
  c->ttft = -1;
  c->total = -1;
  c->tokens = 0;
  c->finished = c->done_marker = 0;
  c->rid[0] = c->err[0] = 0;
  c->errbody_len = 0;
  c->in_len = c->line_len = 0;
  c->state = S_HEAD;
  c->got_bytes = 0;
}

static void flush_out(Conn *c) {
  while (c->out_off < c->out_len) {
    ssize_t w = send(c->fd, c->out + c->out_off, c->out_len - c->out_off, MSG_NOSIGNAL);
    if (w < 0) return; /* EAGAIN (or an error, seen by the read) */
    c->out_off += (size_t)w;
  }
}

static void finish(Conn *c, Result *r, int keep) {
  r->ttft = c->ttft;
  r->total = now() - c->t0;
  r->tokens = c->tokens;
  snprintf(r->rid, sizeof r->rid, "%s", c->rid);
  if (c->err[0]) {
    snprintf(r->err, sizeof r->err, "%s", c->err);
  } else if (c->status != 200) {
    for (size_t i = 0; i < c->errbody_len; i++)
      if (c->errbody[i] == '\t' || c->errbody[i] == '\n' || c->errbody[i] == '\r')
        c->errbody[i] = ' ';
    snprintf(r->err, sizeof r->err, "HTTP %d: %.*s", c->status, (int)c->errbody_len,
             c->errbody);
  } else if (c->t->sse && !c->done_marker) {
    snprintf(r->err, sizeof r->err, "stream ended without [DONE]");
  } else if (!c->t->sse && !c->finished) {
    snprintf(r->err, sizeof r->err, "stream ended without a finish reason");
  } else {
    r->err[0] = 0;
  }
  epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
  Target *t = c->t;
  if (keep && c->keep_alive) {
    if (t->n_idle == t->cap_idle) {
      t->cap_idle = t->cap_idle ? 2 * t->cap_idle : 64;
      t->idle = xrealloc(t->idle, sizeof *t->idle * (size_t)t->cap_idle);
    }
    t->idle[t->n_idle++] = c;
  } else {
    close(c->fd);
    free(c->out), free(c->in), free(c->line), free(c);
  }
}

/* A reused connection the server closed before answering: once more on a new one. */
static Conn *retry(Conn *c) {
  epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
  close(c->fd);
  c->fd = open_socket(c->t);
  c->reused = 0;
  c->out_off = 0;
  c->in_len = 0;
  flush_out(c);
  watch(c, EPOLL_CTL_ADD);
  return c;
}

static void run_batch(Target *t, int count) {
  Result *res = calloc((size_t)count, sizeof *res);
  Conn **live = calloc((size_t)count, sizeof *live);
  if (!res || !live) die("calloc");
  for (int i = 0; i < count; i++) {
    Conn *c = take_conn(t);
    start(c, i, now());
    flush_out(c);
    watch(c, EPOLL_CTL_ADD); /* EPOLLOUT too while part of the request is unsent */
    live[i] = c;
  }
  int left = count;
  struct epoll_event evs[256];
  while (left) {
    double soonest = 1e300;
    for (int i = 0; i < count; i++)
      if (live[i] && live[i]->deadline < soonest) soonest = live[i]->deadline;
    double wait = soonest - now();
    int n = epoll_wait(ep, evs, 256, wait <= 0 ? 0 : (int)(wait * 1000) + 1);
    if (n < 0 && errno != EINTR) die("epoll_wait");
    for (int e = 0; e < n; e++) {
      Conn *c = evs[e].data.ptr;
      if (evs[e].events & EPOLLOUT) {
        flush_out(c);
        if (c->out_off == c->out_len) watch(c, EPOLL_CTL_MOD);
      }
      if (!(evs[e].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) continue;
      int eof = 0, done = 0;
      for (;;) {
        grow(&c->in, &c->in_cap, c->in_len + 65536);
        ssize_t r = recv(c->fd, c->in + c->in_len, c->in_cap - c->in_len, 0);
        if (r > 0) {
          c->in_len += (size_t)r;
          c->got_bytes = 1;
          if (parse(c)) {
            done = 1;
            break;
          }
          continue;
        }
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        if (r < 0 && errno == EINTR) continue;
        eof = 1;
        break;
      }
      if (done) {
        live[c->slot] = NULL;
        finish(c, &res[c->slot], 1);
        left--;
      } else if (eof && c->reused && !c->got_bytes) {
        retry(c);
      } else if (eof) {
        if (c->state == S_LENGTH && c->remaining < 0) { /* a body that ends at EOF */
          live[c->slot] = NULL;
          finish(c, &res[c->slot], 0);
        } else {
          if (!c->err[0]) snprintf(c->err, sizeof c->err, "connection closed mid-response");
          live[c->slot] = NULL;
          finish(c, &res[c->slot], 0);
        }
        left--;
      }
    }
    double t_now = now();
    for (int i = 0; i < count; i++) {
      Conn *c = live[i];
      if (c && c->deadline <= t_now) {
        snprintf(c->err, sizeof c->err, "TimeoutError: no end after %g s", timeout_s);
        live[i] = NULL;
        finish(c, &res[i], 0);
        left--;
      }
    }
  }
  for (int i = 0; i < count; i++) {
    Result *r = &res[i];
    if (r->ttft >= 0) printf("%.9f\t", r->ttft);
    else printf("-\t");
    printf("%.9f\t%ld\t%s\t%s\n", r->total, r->tokens, r->rid[0] ? r->rid : "-",
           r->err[0] ? r->err : "-");
  }
  printf("end\n");
  fflush(stdout);
  free(res);
  free(live);
}

static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) die(path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)n + 1);
  if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) die(path);
  fclose(f);
  buf[n] = 0;
  *len = (size_t)n;
  return buf;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s TIMEOUT_S --target NAME MODE HOST PORT PATH AUTH BODY ...\n",
            argv[0]);
    return 2;
  }
  timeout_s = atof(argv[1]);
  for (int i = 2; i < argc;) {
    if (strcmp(argv[i], "--target") != 0 || i + 8 > argc || n_targets == MAX_TARGETS) {
      fprintf(stderr, "bad arguments at %s\n", argv[i]);
      return 2;
    }
    Target *t = &targets[n_targets++];
    snprintf(t->name, sizeof t->name, "%s", argv[i + 1]);
    t->sse = strcmp(argv[i + 2], "sse") == 0;
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai;
    if (getaddrinfo(argv[i + 3], argv[i + 4], &hints, &ai) != 0 || !ai) {
      fprintf(stderr, "cannot resolve %s:%s\n", argv[i + 3], argv[i + 4]);
      return 2;
    }
    memcpy(&t->addr, ai->ai_addr, ai->ai_addrlen);
    t->addr_len = ai->ai_addrlen;
    freeaddrinfo(ai);
    if (asprintf(&t->head,
                 "POST %s HTTP/1.1\r\nhost: %s:%s\r\ncontent-type: application/json\r\n"
                 "authorization: %s\r\ncontent-length: ",
                 argv[i + 5], argv[i + 3], argv[i + 4], argv[i + 6]) < 0)
      die("asprintf");
    t->body = read_file(argv[i + 7], &t->body_len);
    i += 8;
  }
  ep = epoll_create1(EPOLL_CLOEXEC);
  if (ep < 0) die("epoll_create1");
  id_seed = ((unsigned long long)getpid() << 32) ^ (unsigned long long)(now() * 1e9);
  char line[256], name[64];
  int count;
  while (fgets(line, sizeof line, stdin)) {
    if (sscanf(line, "%63s %d", name, &count) != 2 || count <= 0) {
      fprintf(stderr, "bad command: %s", line);
      return 2;
    }
    Target *t = NULL;
    for (int k = 0; k < n_targets; k++)
      if (strcmp(targets[k].name, name) == 0) t = &targets[k];
    if (!t) {
      fprintf(stderr, "unknown target %s\n", name);
      return 2;
    }
    run_batch(t, count);
  }
  return 0;
}
