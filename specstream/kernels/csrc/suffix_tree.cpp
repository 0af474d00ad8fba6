// A suffix tree of bounded depth over token sequences, for suffix decoding (spec_decode/suffix.py).
//
// The tree holds every substring of at most max_depth tokens of the sequences added to it, each node
// counting how often its substring occurs. A sequence can be extended token by token (each new token
// extends the at most max_depth substrings that end at it: O(max_depth) work) and removed again (its
// substrings' counts are taken back and nodes that reach zero are freed), so a bounded cache of
// earlier requests can drop any of them.
//
// Each node also names the sequence that last wrote it (its id's low 31 bits), and source() gives the writer of
// the latest draft's first node: a bounded cache can keep the requests its drafts come from rather than the
// newest (spec_decode/suffix.py's credit).
//
// speculate() finds where the context's last tokens occur and continues from there, along the most
// frequent children (a path) or best first over all of them (a tree), each draft token with the estimated
// chance that the text goes on that way (child count over parent count, multiplied along the path). As in
// SuffixDecoding (Oliaro et al.), every match length is tried and the draft with the largest sum of chances
// is kept (the expected number of accepted tokens), and a draft may be at most max_spec_factor times its
// match length long: a long match earns a long draft.
//
// Nodes live in one vector and name each other by index; a node's children are a singly linked list
// (first_child, next_sibling) for walking, and one hash map from (parent, token) finds a child. No path
// compression: memory is O(tokens * max_depth), about 48 bytes a node, bounded by the caller's caps.
//
// The interface is plain C (loaded with ctypes): it needs neither torch's headers nor Python's, so it
// builds in about a second. No C++ exception crosses it: each entry point returns an error code instead.

#include <algorithm>
#include <cstdint>
#include <deque>
#include <new>
#include <queue>
#include <unordered_map>
#include <vector>

namespace {

struct Node {
    int64_t count;
    int32_t token;
    int32_t parent;
    int32_t first_child;
    int32_t next_sibling;
    int32_t depth;
    int32_t last_seq;  // the sequence that last wrote it (id & 0x7fffffff), -1 for none: fits the padding after count
};

struct Seq {
    std::vector<int32_t> tokens;
    std::deque<int32_t> active;  // nodes of the substrings ending at the last token, deepest first
};

class Tree {
public:
    explicit Tree(int max_depth) : max_depth_(max_depth) { nodes_.push_back(Node{0, -1, -1, -1, -1, 0, -1}); }

    int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size() - free_.size()); }

    int64_t seq_len(int64_t id) const {
        auto it = seqs_.find(id);
        return it == seqs_.end() ? -1 : static_cast<int64_t>(it->second.tokens.size());
    }

    void extend(int64_t id, const int32_t* tokens, int n) {
        Seq& seq = seqs_[id];
        seq.tokens.reserve(seq.tokens.size() + n);
        const int32_t writer = static_cast<int32_t>(id & 0x7fffffff);
        for (int i = 0; i < n; i++) append(seq, tokens[i], writer);
    }

    bool remove(int64_t id) {
        auto it = seqs_.find(id);
        if (it == seqs_.end()) return false;
        const std::vector<int32_t>& t = it->second.tokens;
        const int n = static_cast<int>(t.size());
        std::vector<int32_t> path;
        path.reserve(max_depth_);
        for (int start = 0; start < n; start++) {
            nodes_[0].count--;  // the root counts the tokens held
            path.clear();
            int32_t node = 0;
            for (int j = start; j < n && j - start < max_depth_; j++) {
                node = child(node, t[j]);
                if (node < 0) break;  // cannot happen while the counts are consistent
                nodes_[node].count--;
                path.push_back(node);
            }
            // Deepest first: a node's descendants never count more than it, so they are freed before it.
            for (auto p = path.rbegin(); p != path.rend(); ++p)
                if (nodes_[*p].count <= 0) unlink(*p);
        }
        seqs_.erase(it);
        return true;
    }

    int64_t count(const int32_t* path, int n) const {
        int32_t node = 0;
        for (int i = 0; i < n; i++) {
            node = child(node, path[i]);
            if (node < 0) return 0;
        }
        return n ? nodes_[node].count : nodes_[0].count;
    }

    // The best draft over every match length: tokens, each token's parent (-1: the context's end), each
    // token's estimated chance, the match length. A path follows the most frequent child at each step; a
    // tree grows best first (the likeliest node not yet taken, among the children of those taken), so
    // every node comes after its parent.
    // The sequence that last wrote the first node of the latest speculate()'s draft, -1 where it drafted nothing.
    int64_t source() const { return source_; }

    int speculate(const int32_t* ctx, int n, int max_tokens, float factor, float min_prob, bool tree,
                  int32_t* out_tokens, int32_t* out_parents, float* out_probs, int* out_match) const {
        std::vector<int32_t> matches;  // the node of the context's last len tokens, by len - 1
        const int longest = std::min(n, max_depth_);
        for (int len = 1; len <= longest; len++) {
            int32_t node = 0;
            for (int i = n - len; i < n && node >= 0; i++) node = child(node, ctx[i]);
            if (node < 0) break;  // a longer suffix cannot occur where this one does not
            matches.push_back(node);
        }
        return best_draft(matches, max_tokens, factor, min_prob, tree, out_tokens, out_parents, out_probs, out_match);
    }

    // As speculate() for the context that is held sequence id's own last tokens: their nodes are the
    // sequence's active ones (every suffix up to max_depth tokens), so no suffix is walked from the root
    // (a root walk per match length is a hash lookup per token: most of a lookup's time in a request's own
    // tree, where every length matches). Nothing where the sequence is not held.
    int speculate_held(int64_t id, int max_tokens, float factor, float min_prob, bool tree, int32_t* out_tokens,
                       int32_t* out_parents, float* out_probs, int* out_match) const {
        auto it = seqs_.find(id);
        if (it == seqs_.end()) {
            *out_match = 0;
            return 0;
        }
        const std::deque<int32_t>& active = it->second.active;  // deepest first
        const std::vector<int32_t> matches(active.rbegin(), active.rend());
        return best_draft(matches, max_tokens, factor, min_prob, tree, out_tokens, out_parents, out_probs, out_match);
    }

private:
    int best_draft(const std::vector<int32_t>& matches, int max_tokens, float factor, float min_prob, bool tree,
                   int32_t* out_tokens, int32_t* out_parents, float* out_probs, int* out_match) const {
        int best_len = 0;
        float best_score = 0.0f;
        *out_match = 0;
        source_ = -1;
        int32_t first = -1;
        std::vector<int32_t> tokens, parents;
        std::vector<float> probs;
        for (int len = 1; len <= static_cast<int>(matches.size()); len++) {
            const int32_t node = matches[len - 1];
            const int cap = std::min(max_tokens, static_cast<int>(len * factor + 1e-6f));
            tokens.clear();
            parents.clear();
            probs.clear();
            const float score = tree ? grow_tree(node, cap, min_prob, tokens, parents, probs, first)
                                     : follow_path(node, cap, min_prob, tokens, parents, probs, first);
            if (!tokens.empty() && score >= best_score) {
                best_score = score;
                best_len = static_cast<int>(tokens.size());
                std::copy(tokens.begin(), tokens.end(), out_tokens);
                std::copy(parents.begin(), parents.end(), out_parents);
                std::copy(probs.begin(), probs.end(), out_probs);
                *out_match = len;
                source_ = nodes_[first].last_seq;
            }
        }
        return best_len;
    }

    static uint64_t key(int32_t parent, int32_t token) {
        return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
    }

    int32_t child(int32_t parent, int32_t token) const {
        auto it = edges_.find(key(parent, token));
        return it == edges_.end() ? -1 : it->second;
    }

    int32_t child_or_new(int32_t parent, int32_t token) {
        auto [it, fresh] = edges_.try_emplace(key(parent, token), -1);
        if (!fresh) return it->second;
        int32_t id;
        const Node node{0, token, parent, -1, nodes_[parent].first_child, nodes_[parent].depth + 1, -1};
        if (!free_.empty()) {
            id = free_.back();
            free_.pop_back();
            nodes_[id] = node;
        } else {
            id = static_cast<int32_t>(nodes_.size());
            nodes_.push_back(node);
        }
        nodes_[parent].first_child = id;
        it->second = id;
        return id;
    }

    void append(Seq& seq, int32_t token, int32_t writer) {
        const size_t before = seq.active.size();
        for (size_t i = 0; i < before; i++) {
            const int32_t node = seq.active.front();
            seq.active.pop_front();
            if (nodes_[node].depth >= max_depth_) continue;  // its substring cannot grow within the depth
            const int32_t next = child_or_new(node, token);
            nodes_[next].count++;
            nodes_[next].last_seq = writer;
            seq.active.push_back(next);
        }
        const int32_t first = child_or_new(0, token);
        nodes_[first].count++;
        nodes_[first].last_seq = writer;
        nodes_[0].count++;
        seq.active.push_back(first);
        seq.tokens.push_back(token);
    }

    void unlink(int32_t id) {
        const Node& node = nodes_[id];
        int32_t* link = &nodes_[node.parent].first_child;
        while (*link != id && *link >= 0) link = &nodes_[*link].next_sibling;
        if (*link == id) *link = node.next_sibling;
        edges_.erase(key(node.parent, node.token));
        nodes_[id].count = 0;
        free_.push_back(id);
    }

    // first: set to the draft's first node (where it drafts any).
    float follow_path(int32_t node, int cap, float min_prob, std::vector<int32_t>& tokens, std::vector<int32_t>& parents,
                      std::vector<float>& probs, int32_t& first) const {
        float prob = 1.0f, score = 0.0f;
        while (static_cast<int>(tokens.size()) < cap) {
            const int32_t next = most_frequent_child(node);
            if (next < 0 || nodes_[node].count <= 0) break;
            prob *= static_cast<float>(nodes_[next].count) / static_cast<float>(nodes_[node].count);
            if (prob < min_prob) break;
            if (tokens.empty()) first = next;
            parents.push_back(static_cast<int32_t>(tokens.size()) - 1);
            tokens.push_back(nodes_[next].token);
            probs.push_back(prob);
            score += prob;
            node = next;
        }
        return score;
    }

    struct Candidate {
        float prob;
        int32_t node;
        int32_t parent;  // index in the draft (-1: the context's end)
        bool operator<(const Candidate& o) const {
            if (prob != o.prob) return prob < o.prob;
            return node > o.node;  // ties: the older node first, so the order does not depend on the heap
        }
    };

    float grow_tree(int32_t node, int cap, float min_prob, std::vector<int32_t>& tokens, std::vector<int32_t>& parents,
                    std::vector<float>& probs, int32_t& first) const {
        std::priority_queue<Candidate> heap;
        auto push_children = [&](int32_t from, float prob, int32_t index) {
            const float total = static_cast<float>(nodes_[from].count);
            if (total <= 0) return;
            for (int32_t c = nodes_[from].first_child; c >= 0; c = nodes_[c].next_sibling) {
                const float p = prob * static_cast<float>(nodes_[c].count) / total;
                if (p >= min_prob && p > 0) heap.push(Candidate{p, c, index});
            }
        };
        push_children(node, 1.0f, -1);
        float score = 0.0f;
        while (!heap.empty() && static_cast<int>(tokens.size()) < cap) {
            const Candidate best = heap.top();
            heap.pop();
            const int32_t index = static_cast<int32_t>(tokens.size());
            if (tokens.empty()) first = best.node;
            tokens.push_back(nodes_[best.node].token);
            parents.push_back(best.parent);
            probs.push_back(best.prob);
            score += best.prob;
            push_children(best.node, best.prob, index);
        }
        return score;
    }

    int32_t most_frequent_child(int32_t node) const {
        int32_t best = -1;
        int64_t best_count = 0;
        for (int32_t c = nodes_[node].first_child; c >= 0; c = nodes_[c].next_sibling)
            if (nodes_[c].count > best_count || (nodes_[c].count == best_count && best >= 0 && nodes_[c].token < nodes_[best].token)) {
                best = c;
                best_count = nodes_[c].count;
            }
        return best;
    }

    int max_depth_;
    mutable int64_t source_ = -1;  // speculate() is const to its callers: the tree's counts do not change
    std::vector<Node> nodes_;
    std::vector<int32_t> free_;
    std::unordered_map<uint64_t, int32_t> edges_;
    std::unordered_map<int64_t, Seq> seqs_;
};

}  // namespace

extern "C" {

void* sst_new(int max_depth) {
    if (max_depth < 1) return nullptr;
    try {
        return new Tree(max_depth);
    } catch (...) {
        return nullptr;
    }
}

void sst_delete(void* tree) { delete static_cast<Tree*>(tree); }

// 0 on success, -1 where memory ran out (the sequence may then be partly added: remove it).
int sst_extend(void* tree, int64_t seq, const int32_t* tokens, int n) {
    try {
        static_cast<Tree*>(tree)->extend(seq, tokens, n);
        return 0;
    } catch (...) {
        return -1;
    }
}

// 1 where the sequence was held and is removed, 0 where it was not held, -1 on failure.
int sst_remove(void* tree, int64_t seq) {
    try {
        return static_cast<Tree*>(tree)->remove(seq) ? 1 : 0;
    } catch (...) {
        return -1;
    }
}

int64_t sst_seq_len(void* tree, int64_t seq) { return static_cast<Tree*>(tree)->seq_len(seq); }

// The sequence (its id's low 31 bits) that last wrote the first token of the latest sst_speculate or
// sst_speculate_held draft, -1 where that drafted nothing.
int64_t sst_source(void* tree) { return static_cast<Tree*>(tree)->source(); }

int64_t sst_num_nodes(void* tree) { return static_cast<Tree*>(tree)->num_nodes(); }

int64_t sst_count(void* tree, const int32_t* path, int n) { return static_cast<Tree*>(tree)->count(path, n); }

// The number of draft tokens written to out_tokens/out_probs (at most max_tokens), or -1 on failure.
// tree: grow a tree (out_parents: each token's parent in the draft, -1 for the context's end) rather than a path.
int sst_speculate(void* tree, const int32_t* ctx, int n, int max_tokens, float factor, float min_prob, int as_tree,
                  int32_t* out_tokens, int32_t* out_parents, float* out_probs, int* out_match) {
    try {
        return static_cast<Tree*>(tree)->speculate(ctx, n, max_tokens, factor, min_prob, as_tree != 0, out_tokens,
                                                   out_parents, out_probs, out_match);
    } catch (...) {
        return -1;
    }
}

// As sst_speculate for held sequence seq's own last tokens (Tree::speculate_held): none where it is not held.
int sst_speculate_held(void* tree, int64_t seq, int max_tokens, float factor, float min_prob, int as_tree,
                       int32_t* out_tokens, int32_t* out_parents, float* out_probs, int* out_match) {
    try {
        return static_cast<Tree*>(tree)->speculate_held(seq, max_tokens, factor, min_prob, as_tree != 0, out_tokens,
                                                        out_parents, out_probs, out_match);
    } catch (...) {
        return -1;
    }
}

}  // extern "C"
