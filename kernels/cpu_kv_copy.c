/* Copy-and-hash of paged KV pieces (kernels/cpu_kv_copy.py builds and loads this file; its docstring is the
 * contract, its Python loops the definition). Plain C11, no torch headers, no xxhash headers: xxh3-128 is the
 * installed xxhash package's own build, whose functions Python resolves and hands over once (pd_kv_copy_init), so
 * the digests are the package's by construction.
 *
 * Block i is num_pieces pieces of piece_bytes bytes at base + bases[i] + p * stride, p = 0 .. num_pieces - 1. The
 * caller has checked that every piece lies inside its buffer: nothing here checks a bound.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* xxhash.h's XXH128_hash_t and XXH128_canonical_t, by value the same structs (the ABI is the platform's). */
typedef struct { uint64_t low64, high64; } pd_xxh128;
typedef struct { unsigned char digest[16]; } pd_xxh128_canonical;

static void *(*xxh3_create_state)(void);
static int (*xxh3_free_state)(void *);
static int (*xxh3_128_reset)(void *);
static int (*xxh3_128_update)(void *, const void *, size_t);
static pd_xxh128 (*xxh3_128_digest)(const void *);
static void (*xxh128_canonical_from_hash)(pd_xxh128_canonical *, pd_xxh128);

void pd_kv_copy_init(void *(*create_state)(void), int (*free_state)(void *), int (*reset)(void *),
                     int (*update)(void *, const void *, size_t), pd_xxh128 (*digest)(const void *),
                     void (*canonical_from_hash)(pd_xxh128_canonical *, pd_xxh128))
{
    xxh3_create_state = create_state;
    xxh3_free_state = free_state;
    xxh3_128_reset = reset;
    xxh3_128_update = update;
    xxh3_128_digest = digest;
    xxh128_canonical_from_hash = canonical_from_hash;
}

/* Each piece starts a new hardware prefetch stream (pieces sit a whole (layer, kv) plane, MBs, apart, and the
 * L2 streamer does not cross 4 KiB pages), and nothing is fetched while a landed piece is hashed from L1. So while
 * piece k is hashed, the head of every 4 KiB page of piece k + 2 is asked for. Measured on a Xeon, 12 KiB pieces,
 * 20 paired runs: copy+hash 6-8% faster (64 and 256 blocks), hash alone 12% faster at 64 blocks, no change at 256
 * (DRAM bound); a whole piece ahead, or prefetching before the copy, is slower (they queue behind its misses). */
#define PREFETCH_AHEAD 2
#define PREFETCH_PAGE_BYTES 512
#if defined(__GNUC__)
#define PREFETCH(address) __builtin_prefetch((address), 0, 3)
#else
#define PREFETCH(address) ((void)(address))
#endif

static void prefetch_piece(const uint8_t *piece, int64_t piece_bytes)
{
    for (int64_t page = 0; page < piece_bytes; page += 4096)
        for (int64_t off = page; off < page + PREFETCH_PAGE_BYTES && off < piece_bytes; off += 64)
            PREFETCH(piece + off);
}

/* dst NULL: hash the source pieces where they are. Otherwise copy each piece, then hash the bytes that landed
 * while they are still in L1/L2 (the receiver must hash what landed, not what it read: kvstore.shm_cache). */
static int copy_hash(const uint8_t *src, const int64_t *src_bases, int64_t src_stride, uint8_t *dst,
                     const int64_t *dst_bases, int64_t dst_stride, int64_t num_blocks, int64_t num_pieces,
                     int64_t piece_bytes, uint8_t *digests)
{
    void *state = xxh3_create_state();
    if (!state)
        return -1;
    for (int64_t i = 0; i < num_blocks; i++) {
        xxh3_128_reset(state);
        for (int64_t p = 0; p < num_pieces; p++) {
            const uint8_t *landed = src + src_bases[i] + p * src_stride;
            if (dst) {
                uint8_t *to = dst + dst_bases[i] + p * dst_stride;
                memcpy(to, landed, (size_t)piece_bytes);
                landed = to;
            }
            int64_t ahead = p + PREFETCH_AHEAD, ahead_block = i + ahead / num_pieces;
            if (ahead_block < num_blocks)
                prefetch_piece(src + src_bases[ahead_block] + ahead % num_pieces * src_stride, piece_bytes);
            xxh3_128_update(state, landed, (size_t)piece_bytes);
        }
        xxh128_canonical_from_hash((pd_xxh128_canonical *)(digests + 16 * i), xxh3_128_digest(state));
    }
    xxh3_free_state(state);
    return 0;
}

/* Copy block i's pieces from src to dst and write the xxh3-128 canonical digest of what landed to digests[16 i]. */
int pd_copy_hash_pieces(const uint8_t *src, const int64_t *src_bases, int64_t src_stride, uint8_t *dst,
                        const int64_t *dst_bases, int64_t dst_stride, int64_t num_blocks, int64_t num_pieces,
                        int64_t piece_bytes, uint8_t *digests)
{
    return copy_hash(src, src_bases, src_stride, dst, dst_bases, dst_stride, num_blocks, num_pieces, piece_bytes,
                     digests);
}

/* The xxh3-128 canonical digest of block i's pieces, where they are, to digests[16 i]. */
int pd_hash_pieces(const uint8_t *src, const int64_t *bases, int64_t stride, int64_t num_blocks, int64_t num_pieces,
                   int64_t piece_bytes, uint8_t *digests)
{
    return copy_hash(src, bases, stride, NULL, NULL, 0, num_blocks, num_pieces, piece_bytes, digests);
}

/* A payload of records streamed in order, in pieces of any length, between a contiguous run of its bytes and the
 * blocks' pieces where they are: the grpc transport's two ends (kvstore.paged_records). */
typedef struct {
    void *hash;      /* xxh3-128 of the current record's bytes so far */
    int64_t fed;     /* payload bytes moved so far */
} pd_stream;

void *pd_stream_new(void)
{
    pd_stream *stream = calloc(1, sizeof(pd_stream));
    if (!stream)
        return NULL;
    stream->hash = xxh3_create_state();
    if (!stream->hash) {
        free(stream);
        return NULL;
    }
    xxh3_128_reset(stream->hash);
    return stream;
}

void pd_stream_free(void *stream)
{
    if (stream) {
        xxh3_free_state(((pd_stream *)stream)->hash);
        free(stream);
    }
}

/* Move the payload's next `len` bytes: land != 0, from `run` into the blocks (record i's piece p at
 * blocks + bases[i] + p * stride); land == 0, from the blocks into `run`. Every stretch is hashed where it was
 * written, right after (in L1): the digest of what landed. A record's last byte writes its canonical digest to
 * digests[16 i] and starts the next hash. Returns the records complete so far; -1 when `len` runs past the
 * num_records records (nothing moved). */
int64_t pd_stream_move(void *stream_, uint8_t *run, int64_t len, int land, uint8_t *blocks, const int64_t *bases,
                       int64_t stride, int64_t num_records, int64_t num_pieces, int64_t piece_bytes,
                       uint8_t *digests)
{
    pd_stream *stream = stream_;
    const int64_t record_bytes = num_pieces * piece_bytes;
    if (len < 0 || len > num_records * record_bytes - stream->fed)
        return -1;
    for (int64_t pos = 0; pos < len;) {
        const int64_t record = stream->fed / record_bytes, within = stream->fed % record_bytes;
        const int64_t piece = within / piece_bytes, offset = within % piece_bytes;
        const int64_t n = piece_bytes - offset < len - pos ? piece_bytes - offset : len - pos;
        uint8_t *at = blocks + bases[record] + piece * stride + offset;
        uint8_t *written = land ? at : run + pos;
        memcpy(written, land ? run + pos : at, (size_t)n);
        if (!land && offset == 0) {  /* reading scattered pieces: prefetched as copy_hash does */
            int64_t ahead = piece + PREFETCH_AHEAD, ahead_record = record + ahead / num_pieces;
            if (ahead_record < num_records)
                prefetch_piece(blocks + bases[ahead_record] + ahead % num_pieces * stride, piece_bytes);
        }
        xxh3_128_update(stream->hash, written, (size_t)n);
        pos += n;
        stream->fed += n;
        if (stream->fed % record_bytes == 0) {
            xxh128_canonical_from_hash((pd_xxh128_canonical *)(digests + 16 * record), xxh3_128_digest(stream->hash));
            xxh3_128_reset(stream->hash);
        }
    }
    return stream->fed / record_bytes;
}
